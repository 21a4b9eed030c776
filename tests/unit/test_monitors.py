"""DeepSpeed's extras zeromem runs: their config blocks, the monitor writers, the comms log."""
from __future__ import annotations

import csv
import importlib.machinery
import importlib.util
import logging
import sys
import types

import pytest

from zeromem.monitoring.comm_log import CommLog, bandwidths
from zeromem.config.extras import CommsLoggerConfig
from zeromem.config.schema import Config, ConfigError, Unsupported
from zeromem.monitoring.monitors import CsvMonitor, TensorBoardMonitor, WandbMonitor, build_monitors, due

EVENTS = [("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 0.1, 8)]


def fake_wandb(monkeypatch) -> list:
    """A stand-in `wandb` module recording init and log calls."""
    calls: list = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.init = lambda **kwargs: calls.append(("init", kwargs))
    module.log = lambda data, step: calls.append(("log", data, step))
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_deepspeeds_extras_load_with_deepspeeds_defaults():
    config = Config.load({"csv_monitor": {"enabled": True, "output_path": "/tmp/x"},
                          "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]},
                          "flops_profiler": {"enabled": True, "profile_step": 3},
                          "timers": {"throughput": {"enabled": False}}, "log_level": "INFO"})
    assert config.csv_monitor.job_name == "DeepSpeedJobName" and config.monitoring
    assert config.comms_logger.prof_all and config.comms_logger.prof_ops == ["all_reduce"]
    assert config.flops_profiler.module_depth == -1 and config.flops_profiler.top_modules == 1
    assert not config.timers.throughput.enabled and config.timers.throughput.synchronized
    assert config.log_level == "info"
    assert not Config.load({}).monitoring
    with pytest.raises(ConfigError, match="did you mean 'output_path'"):
        Config.load({"csv_monitor": {"output_pth": "x"}})
    with pytest.raises(ConfigError, match="flops_profiler.profile_step must be >= 1"):
        Config.load({"flops_profiler": {"profile_step": 0}})


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_monitor_whose_package_is_missing_is_refused():
    with pytest.raises(Unsupported, match="wandb.enabled = True is not supported .*'wandb' package"):
        Config.load({"wandb": {"enabled": True}})
    Config.load({"wandb": {"enabled": False, "project": "p"}})  # off: nothing needed


def test_csv_monitor_writes_deepspeeds_files(tmp_path):
    config = Config.load({"csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                          "job_name": "run"}})
    (monitor,) = build_monitors(config)
    assert isinstance(monitor, CsvMonitor)
    monitor.write(EVENTS)
    monitor.write([("Train/Samples/train_loss", 2.0, 16)])
    rows = list(csv.reader(open(tmp_path / "run" / "Train_Samples_train_loss.csv")))
    assert rows == [["step", "train_loss"], ["8", "2.5"], ["16", "2.0"]]
    assert list(csv.reader(open(tmp_path / "run" / "Train_Samples_lr.csv"))) == [
        ["step", "lr"], ["8", "0.1"]]


def test_tensorboard_monitor_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    config = Config.load({"tensorboard": {"enabled": True, "output_path": str(tmp_path),
                                          "job_name": "run"}})
    (monitor,) = build_monitors(config)
    assert isinstance(monitor, TensorBoardMonitor)
    monitor.write(EVENTS)
    monitor.close()
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    (loss,) = events.Scalars("Train/Samples/train_loss")
    assert (loss.step, loss.value) == (8, 2.5)


def test_wandb_monitor_logs_each_event(monkeypatch):
    calls = fake_wandb(monkeypatch)
    config = Config.load({"wandb": {"enabled": True, "project": "p", "group": "g", "team": "t"}})
    (monitor,) = build_monitors(config)
    assert isinstance(monitor, WandbMonitor)
    monitor.write(EVENTS)
    assert calls == [("init", {"project": "p", "group": "g", "entity": "t"}),
                     ("log", {"Train/Samples/train_loss": 2.5}, 8),
                     ("log", {"Train/Samples/lr": 0.1}, 8)]


def test_steps_per_print_infinity_never_prints():
    assert due(10, 5) and not due(11, 5) and not due(10, float("inf"))


def test_bandwidths_are_deepspeeds_formulas():
    # all_reduce of 1 GB in 1 s on 4 ranks: algbw 2 GB/s, busbw 2 * 3/4 GB/s (in Gbit/s)
    assert bandwidths("all_reduce", 10**9, 1.0, 4) == pytest.approx((16.0, 12.0))
    assert bandwidths("all_gather_into_tensor", 10**9, 1.0, 4) == pytest.approx((8.0, 6.0))
    assert bandwidths("broadcast", 10**9, 2.0, 4) == pytest.approx((4.0, 4.0))


def test_comm_log_records_filters_and_tabulates(caplog):
    everything = CommLog(CommsLoggerConfig(enabled=True, verbose=True, debug=True), 2, 0)
    for collective, kind, nbytes in (("all_reduce", "all_reduce_norm", 4),
                                     ("all_gather", "all_gather", 80), ("all_gather", "all_gather", 80),
                                     ("reduce_scatter", "reduce_scatter", 80)):
        with caplog.at_level(logging.INFO, logger="zeromem"):
            everything.finish(everything.start(collective, kind, nbytes))
    table = everything.table()
    assert table["all_gather_into_tensor"][80]["count"] == 2
    assert set(table) == {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}
    assert "comm op: all_reduce (all_reduce_norm)" in caplog.text and "Caller Func" in caplog.text
    summary = everything.summary()
    assert "all_gather_into_tensor" in summary and "80 B" in summary
    only = CommLog(CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=["all_reduce"]), 2, 0)
    assert only.start("all_gather", "all_gather", 8) is None
    only.finish(only.start("all_reduce", "monitor", 4))
    assert [r.kind for r in only.records] == ["monitor"]
    by_kind = CommLog(CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=["lamb_norms"]), 2, 0)
    assert by_kind.start("all_reduce", "lamb_norms", 4) is not None  # zeromem's kinds name ops too
