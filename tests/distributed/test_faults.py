"""Faults: ranks that disagree, timeouts, clean exits, SIGTERM, restart and resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zeromem
from harness import free_port, run_distributed

SCRIPT = Path(__file__).parent / "faults_script.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"

BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}

# (name, rank 0's change, rank 1's change, a key the error must name)
CONFIG_PAIRS = [
    ("stage 2 vs 3", {"zero_optimization": {"stage": 2}}, {"zero_optimization": {"stage": 3}},
     "zero_optimization.stage"),
    ("stage 1 vs 2", {"zero_optimization": {"stage": 1}}, {"zero_optimization": {"stage": 2}},
     "zero_optimization.stage"),
    ("reduce bucket", {"zero_optimization": {"stage": 2, "reduce_bucket_size": 100}},
     {"zero_optimization": {"stage": 2, "reduce_bucket_size": 200}}, "reduce_bucket_size"),
    ("allgather bucket", {"zero_optimization": {"stage": 2, "allgather_bucket_size": 100}},
     {"zero_optimization": {"stage": 2, "allgather_bucket_size": 300}}, "allgather_bucket_size"),
    ("overlap_comm", {"zero_optimization": {"stage": 2, "overlap_comm": True}},
     {"zero_optimization": {"stage": 2, "overlap_comm": False}}, "overlap_comm"),
    ("fp32 vs bf16", {}, {"bf16": {"enabled": True}}, "bf16.enabled"),
    ("bf16 vs fp16", {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}}, "fp16.enabled"),
    ("lr", {}, {"optimizer": {"type": "Adam", "params": {"lr": 2e-3}}}, "optimizer.params.lr"),
    ("optimizer type", {}, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
     "optimizer.type"),
    ("clipping", {"gradient_clipping": 1.0}, {"gradient_clipping": 0.5}, "gradient_clipping"),
    ("accumulation", {}, {"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
    ("micro batch", {}, {"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu"),
    ("gather timeout", {}, {"zeromem": {"gather_timeout_s": 5}}, "zeromem.gather_timeout_s"),
]


def _model(rank: int, change: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    width = 12 if change == "shape" and rank == 1 else 16
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
    if change == "frozen" and rank == 1:
        model[2].bias.requires_grad_(False)
    if change == "dtype" and rank == 1:
        model[0].double()
    if change == "extra" and rank == 1:
        model.append(torch.nn.Linear(4, 4))
    return model


def _mismatch_cases(rank: int, world_size: int) -> dict:
    seen = {}
    for name, first, second, key in CONFIG_PAIRS:
        config = {**BASE, **(first if rank == 0 else second)}
        try:
            zeromem.initialize(_model(rank), config)
            seen[name] = "no error"
        except zeromem.RankMismatchError as error:
            seen[name] = "named" if key in str(error) and "rank 1" in str(error) else str(error)
    for change, param in (("frozen", "2.bias"), ("shape", "0.weight"), ("dtype", "0.weight"),
                          ("extra", "3.weight")):
        try:
            zeromem.initialize(_model(rank, change), BASE)
            seen[change] = "no error"
        except zeromem.RankMismatchError as error:
            seen[change] = "named" if f"'{param}'" in str(error) else str(error)
    # agreeing ranks train; close() finishes and drops every collective in flight
    engine = zeromem.initialize(_model(0), {**BASE, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
    engine.comm.all_reduce(torch.ones(4), async_op=True)  # not waited: in flight at close
    assert len(engine.comm._in_flight) >= 1
    seen["stage3 gather timeout from config"] = engine.stage3.limits.gather_timeout_s
    engine.close()
    seen["in flight after close"] = len(engine.comm._in_flight)
    return seen


def test_ranks_with_different_configs_or_models_fail_on_every_rank():
    results = run_distributed(_mismatch_cases, 2, timeout_s=240)
    for seen in results:
        named = {k: v for k, v in seen.items() if k not in (
            "stage3 gather timeout from config", "in flight after close")}
        assert named == {k: "named" for k in named}, named
        assert len(named) == len(CONFIG_PAIRS) + 4
        assert seen["stage3 gather timeout from config"] == 300.0
        assert seen["in flight after close"] == 0


def test_timeouts_come_from_config_and_environment(monkeypatch):
    from zeromem.distributed import collective_timeout_s, gather_timeout_s
    config = zeromem.Config.load({**BASE, "zeromem": {"timeout_s": 30, "gather_timeout_s": 0}})
    monkeypatch.delenv("ZEROMEM_TIMEOUT_S", raising=False)
    monkeypatch.delenv("ZEROMEM_GATHER_TIMEOUT_S", raising=False)
    assert collective_timeout_s(config.zeromem.timeout_s) == 30
    assert gather_timeout_s(config.zeromem.gather_timeout_s) is None  # 0 = no limit
    assert collective_timeout_s() == 600 and gather_timeout_s() == 300
    monkeypatch.setenv("ZEROMEM_TIMEOUT_S", "7")  # the environment overrides the file
    monkeypatch.setenv("ZEROMEM_GATHER_TIMEOUT_S", "4")
    assert collective_timeout_s(config.zeromem.timeout_s) == 7
    assert gather_timeout_s(config.zeromem.gather_timeout_s) == 4
    with pytest.raises(zeromem.ConfigError, match="zeromem.timeout_s"):
        zeromem.Config.load({**BASE, "zeromem": {"timeout_s": 0}})


def _torchrun(mode: str, out: Path, *extra: str, env: dict | None = None, timeout_s: float = 90):
    """Launch faults_script.py on 2 ranks; a hang fails the test with the output so far."""
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", *extra, str(SCRIPT),
               mode, str(out)]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"torchrun {mode} ran past {timeout_s}s\nstdout: {error.stdout}\n"
                    f"stderr: {str(error.stderr)[-3000:]}")


def test_exit_path_ends_the_group_and_exits_zero(tmp_path):
    run = _torchrun("exit", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        assert (tmp_path / f"exit{rank}.txt").read_text() == "group after shutdown: False"


def test_a_group_the_script_created_is_ended_at_exit(tmp_path):
    """Left alive when the interpreter finalizes, a gloo group now and then aborts the
    finished process (SIGABRT, pytorch#179291): zeromem's exit handler ends it."""
    run = _torchrun("own_group", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        assert (tmp_path / f"exit{rank}.txt").read_text() == "group at exit: False"


def test_frozen_rank_fails_the_others_within_the_config_timeout(tmp_path):
    began = time.monotonic()
    run = _torchrun("frozen", tmp_path)
    assert run.returncode != 0
    assert "failed after " in run.stdout, run.stdout
    seconds = float(run.stdout.split("failed after ")[1].split("s:")[0])
    assert seconds < 3 + 3 + 5, run.stdout  # the config's 3 s, 3 s asking who answers, slack
    assert "rank(s) [1] stopped answering" in run.stdout, run.stdout
    assert time.monotonic() - began < 30 + 60


def test_sigterm_closes_the_engine_and_removes_swap_files(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "sigterm", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        assert any(tmp_path.iterdir())  # the swap directory exists while training
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
    assert list(tmp_path.iterdir()) == []


def test_killed_rank_restarts_and_resumes_bit_exactly(tmp_path):
    # one launch: the uninterrupted reference first, then the run whose rank 1 dies at step 3
    run = _torchrun("train", tmp_path, "--max-restarts", "1", env={"KILL_AT_STEP": "3"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "SIGKILL" in run.stderr or "Signal 9" in run.stderr or "-9" in run.stderr
    expected = json.loads((tmp_path / "reference.json").read_text())
    assert len(expected) == 6
    assert json.loads((tmp_path / "losses.json").read_text()) == expected


def test_each_restart_round_reads_only_its_own_keys(monkeypatch):
    """torchrun's agent store outlives a round: a restarted rank must not read the old keys."""
    from datetime import timedelta

    import torch.distributed as dist
    from zeromem.distributed import round_store
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # connect as a client
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    round_store(0, 2, timedelta(seconds=5)).set("rank_1", "address of a rank that died")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = round_store(0, 2, timedelta(seconds=5))
    assert not restarted.check(["rank_1"])  # gloo would wait for the new peer's key
    restarted.set("rank_1", "new address")
    assert agent_store.get("zeromem/restart1/rank_1") == b"new address"
