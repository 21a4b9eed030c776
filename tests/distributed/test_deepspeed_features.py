"""DeepSpeed config features zeromem implements, in 2-rank runs (gloo, CPU).

- Lamb from the config trains like one process running Lamb on whole parameters, at
  stages 0-3: the trust ratio is each parameter's, though its shards sit on two ranks.
- OneCycle from the config moves the lr and Adam's beta1 of the master shards' optimizer
  step by step as in one process, and the training matches.
- csv_monitor, tensorboard and wandb (a stand-in module) get, from rank 0 only, each
  step's loss averaged over both ranks, lr, gradient norm and memory; comms_logger's
  records add up to the communication ledger's bytes; flops_profiler counts exactly the
  flops of the profiled step, per module.
"""
from __future__ import annotations

import copy
import csv
import importlib.machinery
import logging
import sys
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import zeromem
from harness import run_distributed
from models import Reference, micro_batch, state_dict_diff, uses_sometimes
from setups import build_tiny_lm, parity_config
from zeromem.optim.optimizers import Lamb
from zeromem.optim.schedulers import OneCycle

STEPS = 4
LAMB = {"type": "Lamb", "params": {"lr": 2e-2, "weight_decay": 0.01, "max_coeff": 10.0,
                                   "min_coeff": 0.01}}


def lamb_parity(rank: int, world_size: int, stage: int) -> float:
    per_rank = stage < 3
    ref = Reference(build_tiny_lm(False), per_rank=per_rank)
    ref.opt = Lamb(ref.params, **LAMB["params"])  # whole parameters: one ratio each
    initial = copy.deepcopy(ref.model)
    engine = zeromem.initialize(build_tiny_lm(False),
                                parity_config(stage, 1, 0.0, world_size, optimizer=LAMB))
    assert isinstance(engine.optimizer, Lamb)
    worst = 0.0
    for step in range(STEPS):
        tokens, targets = micro_batch(step, rank, 0)
        engine.backward(engine(tokens, targets, uses_sometimes(step, rank, 0, per_rank)))
        engine.step()
        ref.step(step, world_size, 1)
        worst = max(worst, state_dict_diff(engine.full_state_dict(), ref.model))
    trained = state_dict_diff(engine.full_state_dict(), initial)  # collective: every rank
    assert rank > 0 or trained > 1e-3
    if stage > 0:  # the case a per-shard ratio gets wrong: parameters split over the ranks
        assert any(0 < g.layout.owned_slice(s.offset, s.numel)[2] < s.numel
                   for g in engine.groups for s in g.slots)
    return worst


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lamb_trains_like_whole_parameter_lamb(features, stage):
    worst = [r["lamb"][stage] for r in features]
    assert max(worst) <= 1e-5, worst


ONE_CYCLE = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 3e-2,
                                            "cycle_first_step_size": 2, "cycle_second_step_size": 3,
                                            "decay_step_size": 1, "decay_lr_rate": 0.5,
                                            "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}}


def one_cycle_parity(rank: int, world_size: int, stage: int) -> tuple[float, list]:
    ref = Reference(build_tiny_lm(False), lr=0.5)  # OneCycle sets absolute lrs
    ref_schedule = OneCycle(ref.opt, **ONE_CYCLE["params"])
    engine = zeromem.initialize(build_tiny_lm(False), parity_config(
        stage, 1, 0.0, world_size, optimizer={"type": "AdamW", "params": {"lr": 0.5,
                                                                           "weight_decay": 0.01}},
        scheduler=ONE_CYCLE))
    assert isinstance(engine.lr_scheduler, OneCycle)
    worst, seen = 0.0, []
    for step in range(8):  # the whole cycle and three decay steps
        group, want = engine.optimizer.param_groups[0], ref.opt.param_groups[0]
        assert group["lr"] == want["lr"] and group["betas"] == want["betas"], step
        seen.append((group["lr"], group["betas"][0]))
        tokens, targets = micro_batch(step, rank, 0)
        engine.backward(engine(tokens, targets, uses_sometimes(step, rank, 0)))
        engine.step()
        ref.step(step, world_size, 1)
        ref_schedule.step()
        worst = max(worst, state_dict_diff(engine.full_state_dict(), ref.model))
    return worst, seen


def test_one_cycle_drives_lr_and_momentum_of_the_sharded_optimizer(features):
    results = [r["one_cycle"] for r in features]
    assert max(worst for worst, _ in results) <= 1e-5
    lrs = [lr for lr, _ in results[0][1]]
    moms = [mom for _, mom in results[0][1]]
    assert lrs[:6] == pytest.approx([1e-3, 1.55e-2, 3e-2, 2.033e-2, 1.067e-2, 1e-3], rel=1e-3)
    assert lrs[6:] == pytest.approx([1e-3 / 1.5, 1e-3 / 2.0])  # decay after the cycle
    assert moms[0] == 0.85 and moms[2] == pytest.approx(0.85) and moms[5] == pytest.approx(0.95)


def reporting(rank: int, world_size: int, out: str, stage: int) -> dict:
    calls: list = []  # a stand-in wandb: what rank 0's monitor sends it
    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    wandb.init = lambda **kwargs: calls.append(("init", kwargs))
    wandb.log = lambda data, step: calls.append((step, data))
    sys.modules["wandb"] = wandb
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeromem").addHandler(handler)
    config = parity_config(stage, 1, 0.0, world_size, steps_per_print=1, log_level="info",
                           csv_monitor={"enabled": True, "output_path": out, "job_name": "csv"},
                           tensorboard={"enabled": True, "output_path": out, "job_name": "tb"},
                           wandb={"enabled": True, "project": "zeromem-test"},
                           comms_logger={"enabled": True},
                           flops_profiler={"enabled": True, "profile_step": 2, "top_modules": 3,
                                           "output_file": f"{out}/flops.txt"},
                           memory_breakdown=True, dump_state=True)
    # an older engine, still open and logging: log_summary reports the newest one's
    older = zeromem.initialize(build_tiny_lm(False), parity_config(
        stage, 1, 0.0, world_size, comms_logger={"enabled": True}))
    tokens, targets = micro_batch(0, rank, 0)
    older.backward(older(tokens, targets))
    older.step()
    engine = zeromem.initialize(build_tiny_lm(False), config)
    before = dict(engine.comm_report().total)  # the log starts here (not the init's broadcasts)
    per_step = []
    for step in range(3):
        tokens, targets = micro_batch(step, rank, 0)
        loss = engine(tokens, targets, uses_sometimes(step, rank, 0, stage < 3))
        engine.backward(loss)
        engine.step()
        per_step.append({"loss": loss.item(), "lr": engine.get_lr()[0], "norm": engine.grad_norm,
                         "bytes": engine.memory_report().model_state_bytes()})
    from zeromem.deepspeed import comm as deepspeed_comm
    table = deepspeed_comm.log_summary(return_dict=True)
    records = [(r.op, r.kind, r.nbytes) for r in engine.comm.log.records]
    totals = {k: v - before.get(k, 0) for k, v in engine.comm_report().total.items()}
    flops = engine.observers.flops.result
    engine.close()
    older.close()
    logging.getLogger("zeromem").removeHandler(handler)
    return {"steps": per_step, "wandb": calls, "table": table, "records": records,
            "ledger": totals, "flops": flops, "messages": messages}


def profiled_step_flops(stage: int) -> tuple[float, float]:
    """The forward and backward flops of step 1's micro-batch (rank 0) in one plain process."""
    model = build_tiny_lm(False)
    tokens, targets = micro_batch(1, 0, 0)
    with FlopCounterMode(display=False) as forward:
        loss = model(tokens, targets, uses_sometimes(1, 0, 0, stage < 3))
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize("stage", [2, 3])
def test_monitors_comms_logger_and_flops_profiler_report(features, features_dir, stage):
    results = [r["reporting"][stage] for r in features]
    tmp_path = features_dir / f"stage{stage}"
    ranks = [r["steps"] for r in results]
    samples = [8 * (step + 1) for step in range(3)]  # train_batch_size 8 per step
    # CSV: rank 0's rows only (one per step), DeepSpeed's file names and header
    rows = {name: list(csv.reader(open(tmp_path / "csv" / f"Train_Samples_{name}.csv")))
            for name in ("train_loss", "lr", "grad_norm", "model_state_bytes")}
    assert rows["train_loss"][0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows["train_loss"][1:]] == samples
    mean_loss = [(a["loss"] + b["loss"]) / 2 for a, b in zip(*ranks)]
    assert [float(r[1]) for r in rows["train_loss"][1:]] == pytest.approx(mean_loss, rel=1e-6)
    assert [float(r[1]) for r in rows["lr"][1:]] == pytest.approx([s["lr"] for s in ranks[0]])
    assert [float(r[1]) for r in rows["grad_norm"][1:]] == pytest.approx([s["norm"] for s in ranks[0]])
    assert [float(r[1]) for r in rows["model_state_bytes"][1:]] == [s["bytes"] for s in ranks[0]]
    assert not (tmp_path / "csv" / "Train_Samples_loss_scale.csv").exists()  # fp32: DeepSpeed neither
    # TensorBoard and wandb got the same events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("Train/Samples/train_loss")] == pytest.approx(mean_loss)
    wandb = results[0]["wandb"]
    assert wandb[0] == ("init", {"project": "zeromem-test", "group": None, "entity": None})
    assert [data["Train/Samples/train_loss"] for step, data in wandb[1:]
            if "Train/Samples/train_loss" in data] == pytest.approx(mean_loss)
    assert results[1]["wandb"] == []  # rank 1 writes nothing
    # comms_logger: one record per collective, adding up to the ledger's bytes
    for r in results:
        n = 2
        sent = {"reduce_scatter": 0.0, "all_gather": 0.0, "all_reduce": 0.0}
        for op, kind, nbytes in r["records"]:
            if op == "reduce_scatter_tensor":
                sent["reduce_scatter"] += (n - 1) / n * nbytes
            elif op == "all_gather_into_tensor":
                sent["all_gather"] += (n - 1) / n * nbytes
            elif op == "all_reduce":
                sent["all_reduce"] += 2 * (n - 1) / n * nbytes
        ledger = r["ledger"]
        assert sent["reduce_scatter"] == pytest.approx(ledger["reduce_scatter"])
        gathered = sum(v for k, v in ledger.items() if k.startswith("all_gather"))  # stage 3: by pass
        assert sent["all_gather"] == pytest.approx(gathered)
        reduced = sum(v for k, v in ledger.items() if k.startswith("all_reduce") or k == "monitor")
        assert sent["all_reduce"] == pytest.approx(reduced)
        assert sum(row["count"] for sizes in r["table"].values() for row in sizes.values()) \
            == len(r["records"])
        assert {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"} <= set(r["table"])
    assert any("communication summary (comms_logger)" in m for m in results[0]["messages"])
    # flops_profiler: step 2 counted exactly, per module; rank 0 wrote the summary
    forward, backward = profiled_step_flops(stage)
    flops = results[0]["flops"]
    assert (flops["fwd_flops"], flops["bwd_flops"]) == (forward, backward)
    assert flops["modules"]["TinyLM.fc1"] == 2 * 20 * 10 * 7  # 4 x 5 tokens, Linear(10, 7)
    text = (tmp_path / "flops.txt").read_text()
    assert "zeromem flops profiler (step 2)" in text and "TinyLM.head" in text
    # dump_state, memory_breakdown and the throughput in the step lines
    messages = "\n".join(results[0]["messages"])
    assert "zeromem config (dump_state)" in messages and "samples/s" in messages
    assert "model states" in messages  # the memory report in each step line


def loader_lengths(rank: int, world_size: int) -> list[int]:
    import zeromem.deepspeed as deepspeed
    data = torch.utils.data.TensorDataset(torch.arange(10.0).view(10, 1))
    lengths = []
    for drop_last in (False, True):
        config = {"train_micro_batch_size_per_gpu": 2, "dataloader_drop_last": drop_last,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, _, loader, _ = deepspeed.initialize(model=torch.nn.Linear(1, 1), config=config,
                                                    training_data=data)
        lengths.append(len(loader))
        engine.destroy()
    return lengths


def test_dataloader_drop_last_reaches_the_training_loader(features):
    # 10 samples, 5 per rank, micro-batches of 2: the last, short batch is dropped or kept
    assert [r["loader"] for r in features] == [[3, 2], [3, 2]]


def every_feature(rank: int, world_size: int, out: str) -> dict:
    """All of this file's runs in one world: spawning one costs more than most runs here."""
    return {"lamb": {stage: lamb_parity(rank, world_size, stage) for stage in range(4)},
            "one_cycle": one_cycle_parity(rank, world_size, 2),
            "reporting": {stage: reporting(rank, world_size, f"{out}/stage{stage}", stage)
                          for stage in (2, 3)},
            "loader": loader_lengths(rank, world_size)}


@pytest.fixture(scope="module")
def features_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


@pytest.fixture(scope="module")
def features(features_dir) -> list[dict]:
    return run_distributed(every_feature, 2, str(features_dir))
