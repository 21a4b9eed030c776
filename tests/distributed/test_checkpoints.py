"""Checkpoints: resume parity across (stage, world size), atomic saves, consolidation, bad input.

Spawning a world costs seconds, so every multi-rank case runs inside one of two
spawned worlds (2 and 4 ranks) prepared by the module fixture `worlds`; world
size 1 runs in this process (no process group). A global batch is always G
micro-batches, split over however many ranks a run has, so runs of different
world sizes train on exactly the same data and must agree with one reference.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import zeromem
from harness import run_distributed
from models import BufferedLM, Reference, micro_batch
from setups import G, PARTITION_ALL, SAVE_BUCKET, checkpoint_config, train_global_batch
from zeromem.checkpoints import save_load as ckpt
from zeromem.checkpoints.save_load import CheckpointError
from zeromem.checkpoints.consolidate import RECOVERY_SCRIPTS, load_consolidated
from zeromem.optim.schedulers import WarmupLR

SAVE_AT, RESUME = 2, 2  # optimizer steps before the save, and after the load
LOAD_BUCKET = 37  # a bucket other than SAVE_BUCKET: different flat groups on load

# (stage, world size) that saves -> (stage, world size) that resumes. A stage-3 case is one line.
RESUME_CASES = [
    ((2, 2), (2, 1)),  # 2 ranks -> 1
    ((1, 1), (1, 4)),  # 1 rank -> 4
    ((2, 2), (0, 2)),  # stage 2 -> 0
    ((0, 2), (1, 2)),  # stage 0 -> 1
    ((1, 2), (2, 2)),  # stage 1 -> 2
    ((0, 1), (2, 2)),  # 1 rank at stage 0 -> 2 ranks at stage 2
    ((2, 2), (3, 2)),  # stage 2 -> 3
    ((3, 2), (1, 1)),  # stage 3 on 2 ranks -> stage 1 on 1
    ((3, 2), (0, 2)),  # stage 3 -> 0
]


def assert_partitioned(engine) -> None:
    """At stage 3 on several ranks, every unit holds only its shard between uses."""
    if engine.zero_stage != 3 or engine.comm.world_size == 1:
        return
    units = engine.stage3.units
    assert units and not any(u.persistent for u in units)
    assert all(u.group.param_shard.numel() < u.group.numel for u in units)


def shard_diff(engine, expected: dict[str, torch.Tensor]) -> float:
    """Max difference of this rank's master shard from its slice of the expected parameters
    (what each rank holds, so every rank checks; parameters are empty at stage 3)."""
    diffs = [0.0]
    for g in engine.groups:
        for slot in g.slots:
            s0, p0, n = g.owned_slice(slot)
            want = expected[slot.name].flatten()[p0:p0 + n]
            diffs.append((g.master.detach()[s0:s0 + n] - want).abs().max().item() if n else 0.0)
    return max(diffs)


def assert_shards_match(engine, full: dict[str, torch.Tensor], dtype=torch.float32) -> None:
    """This rank's master shard equals its slice of a whole state dict (`dtype` on disk)."""
    for g in engine.groups:
        for slot in g.slots:
            s0, p0, n = g.owned_slice(slot)
            mine = g.master.detach()[s0:s0 + n].to(dtype)
            assert torch.equal(mine, full[slot.name].flatten()[p0:p0 + n]), slot.name


def reference(steps: int) -> list[dict[str, torch.Tensor]]:
    """Parameters after each step of one uninterrupted process on the global batch."""
    torch.manual_seed(0)
    ref = Reference(BufferedLM(), lr=1e-2, clip=0.05, per_rank=False)
    schedule = WarmupLR(ref.opt, 1e-3, 1e-2, 5, "linear")
    out = []
    for step in range(steps):
        ref.step(step, G, 1)
        schedule.step()
        out.append({n: p.detach().clone() for n, p in ref.model.named_parameters()})
    return out


def case_dir(root: Path, stage: int, world_size: int) -> Path:
    return root / f"s{stage}w{world_size}"


# ---------------------------------------------------------------- jobs run inside a world

def save_source(rank: int, world_size: int, root: Path, stage: int) -> None:
    torch.manual_seed(0)
    engine = zeromem.initialize(BufferedLM(), checkpoint_config(stage, world_size))
    train_global_batch(engine, rank, world_size, range(SAVE_AT))
    assert_partitioned(engine)
    engine.save_checkpoint(case_dir(root, stage, world_size), client_state={"position": SAVE_AT})
    full = engine.full_state_dict()
    if rank == 0:
        torch.save(full, case_dir(root, stage, world_size) / "full_state_dict.pt")
    engine.comm.barrier()
    assert_shards_match(engine, torch.load(case_dir(root, stage, world_size) /
                                           "full_state_dict.pt", weights_only=True))


def resume(rank: int, world_size: int, root: Path, source: tuple, stage: int) -> list[float]:
    torch.manual_seed(100 + rank)  # another initialisation: the load must replace all of it
    engine = zeromem.initialize(BufferedLM(), checkpoint_config(stage, world_size, LOAD_BUCKET))
    engine.module.position.fill_(-1.0)
    assert_partitioned(engine)
    path, client = engine.load_checkpoint(case_dir(root, *source))
    assert_shards_match(engine, torch.load(case_dir(root, *source) / "full_state_dict.pt",
                                           weights_only=True))
    assert client == {"position": SAVE_AT} and path.endswith(f"global_step{SAVE_AT}")
    assert engine.global_steps == SAVE_AT and engine.micro_steps == SAVE_AT * (G // world_size)
    assert torch.equal(engine.module.position, torch.arange(5.0))
    expected = reference(SAVE_AT + RESUME)
    diffs = []
    for step in range(SAVE_AT, SAVE_AT + RESUME):
        train_global_batch(engine, rank, world_size, [step])
        diffs.append(shard_diff(engine, expected[step]))
    assert max(diffs) <= 1e-5, f"{source} -> {(stage, world_size)}: {diffs}"
    # DeepSpeed's WarmupLR after SAVE_AT + RESUME steps: at last_batch_iteration SAVE_AT + RESUME - 1
    assert engine.get_lr()[0] == pytest.approx(1e-3 + (1e-2 - 1e-3) * (SAVE_AT + RESUME - 1) / 5)
    return diffs


def failing_rank_keeps_previous(rank: int, world_size: int, root: Path) -> str:
    """One rank fails while writing its shard: every rank raises, nothing is published."""
    torch.manual_seed(0)
    engine = zeromem.initialize(BufferedLM(), checkpoint_config(2, world_size))
    train_global_batch(engine, rank, world_size, range(1))
    save_dir = root / "failing"
    engine.save_checkpoint(save_dir, tag="first")
    train_global_batch(engine, rank, world_size, range(1, 2))
    real = ckpt._write_rank_file

    def fail_on_rank_1(engine, tmp, rank, *options):
        real(engine, tmp, rank, *options)
        if rank == 1:
            raise OSError("disk full (injected)")

    ckpt._write_rank_file = fail_on_rank_1
    try:
        with pytest.raises(CheckpointError) as error:
            engine.save_checkpoint(save_dir, tag="second")
    finally:
        ckpt._write_rank_file = real
    assert (save_dir / "latest").read_text() == "first"
    engine.comm.barrier()
    assert sorted(os.listdir(save_dir)) == sorted(["first", "latest", *RECOVERY_SCRIPTS])
    assert engine.load_checkpoint(save_dir)[0].endswith("first")
    return str(error.value)


def corrupt_file_fails_everywhere(rank: int, world_size: int, root: Path) -> str:
    """A bad file checked by rank 1 only still stops rank 0, with the same message."""
    source, bad = case_dir(root, 2, 2), root / "corrupt-2ranks"
    if rank == 0:
        shutil.copytree(source, bad)
        flip_byte(bad / f"global_step{SAVE_AT}" / "rank00001.safetensors")
    torch.manual_seed(0)
    engine = zeromem.initialize(BufferedLM(), checkpoint_config(1, world_size))
    before = engine_snapshot(engine)
    engine.comm.barrier()
    with pytest.raises(CheckpointError, match="rank00001.safetensors is corrupted") as error:
        engine.load_checkpoint(bad)
    assert_same_snapshot(before, engine_snapshot(engine))
    return str(error.value)


def rng_and_fp16_round_trip(rank: int, world_size: int, root: Path) -> None:
    """Same world: generators, loss scaler and fp16 parameters come back exactly."""
    extra = {"fp16": {"enabled": True, "initial_scale_power": 8}}
    torch.manual_seed(0)
    engine = zeromem.initialize(BufferedLM(), checkpoint_config(1, world_size, **extra))
    train_global_batch(engine, rank, world_size, range(2))
    engine.save_checkpoint(root / "fp16", tag="t")
    draws = (torch.rand(3), random.random())
    params = [p.detach().clone() for p in engine.module.parameters()]
    scaler = engine.scaler.state_dict()
    torch.manual_seed(5)
    other = zeromem.initialize(BufferedLM(), checkpoint_config(2, world_size, LOAD_BUCKET, **extra))
    other.load_checkpoint(root / "fp16")
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]
    assert other.scaler.state_dict() == scaler
    assert all(torch.equal(p, q) for p, q in zip(other.module.parameters(), params))
    assert other.module.fc1.weight.dtype == torch.float16


def sixteen_bit_model(rank: int, world_size: int, root: Path) -> None:
    """Stage 3 gathers only with the flag; the file equals full_state_dict() in bf16."""
    torch.manual_seed(0)
    engine = zeromem.initialize(BufferedLM(), checkpoint_config(3, world_size, bf16={"enabled": True}))
    with pytest.raises(CheckpointError, match="stage3_gather_16bit_weights_on_model_save"):
        engine.save_16bit_model(root / "16bit")
    torch.manual_seed(0)
    flag = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True, **PARTITION_ALL}
    engine = zeromem.initialize(BufferedLM(), checkpoint_config(3, world_size, bf16={"enabled": True},
                                                     zero_optimization=flag))
    train_global_batch(engine, rank, world_size, range(1))
    assert_partitioned(engine)
    full = engine.full_state_dict()
    for name in ("model.bin", "model.safetensors"):
        path = engine.save_16bit_model(root / "16bit", name)
        if rank == 0:
            saved = load_consolidated(path)
            assert list(saved) == list(full) and saved["fc1.weight"].dtype == torch.bfloat16
            assert all(torch.equal(saved[k].float(), full[k].to(saved[k].dtype).float())
                       for k in full)
        engine.comm.barrier()  # every rank checks its own shard against the file
        assert_shards_match(engine, load_consolidated(path), torch.bfloat16)


def run_jobs(rank: int, world_size: int, root: Path, jobs: list) -> dict:
    return {name: fn(rank, world_size, root, *args) for name, fn, args in jobs}


def run_world(world_size: int, root: Path, jobs: list) -> dict:
    if world_size == 1:
        return run_jobs(0, 1, root, jobs)
    return run_distributed(run_jobs, world_size, root, jobs, timeout_s=240)[0]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> tuple[Path, dict]:
    """Saves, then resumes, each in the world of its size, in as few worlds as possible."""
    root = tmp_path_factory.mktemp("checkpoints")
    extra = {2: [("fail", failing_rank_keeps_previous, ()), ("rng", rng_and_fp16_round_trip, ()),
                 ("16bit", sixteen_bit_model, ())]}
    sizes = sorted({s[1] for s, _ in RESUME_CASES} | {d[1] for _, d in RESUME_CASES} | set(extra))
    results, done = {}, set()
    for ws in sizes:
        jobs = [(f"save {s}", save_source, (s[0],)) for s in sorted({s for s, _ in RESUME_CASES})
                if s[1] == ws]
        jobs += extra.get(ws, [])
        ready = [c for c in RESUME_CASES if c[1][1] == ws and c[0][1] <= ws]
        jobs += [(c, resume, (c[0], c[1][0])) for c in ready]
        if ws == 2:  # needs the 2-rank source saved above
            jobs.append(("corrupt", corrupt_file_fails_everywhere, ()))
        results.update(run_world(ws, root, jobs))
        done.update(ready)
    for ws in sizes:  # resumes onto fewer ranks than the save had
        jobs = [(c, resume, (c[0], c[1][0])) for c in RESUME_CASES
                if c not in done and c[1][1] == ws]
        if jobs:
            results.update(run_world(ws, root, jobs))
    return root, results


# ---------------------------------------------------------------- multi-rank behaviour

@pytest.mark.parametrize("case", RESUME_CASES,
                         ids=lambda c: f"s{c[0][0]}w{c[0][1]}-s{c[1][0]}w{c[1][1]}")
def test_resume_parity(worlds, case):
    _, results = worlds
    assert max(results[case]) <= 1e-5


def test_failure_on_one_rank_publishes_nothing(worlds):
    assert "writing the checkpoint shards failed on rank(s) [1]" in worlds[1]["fail"]


def test_corrupt_file_checked_by_another_rank_stops_all(worlds):
    assert "rank00001.safetensors" in worlds[1]["corrupt"]


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_consolidate_equals_full_state_dict(worlds, tmp_path, suffix):
    from zeromem.cli import main
    source = case_dir(worlds[0], 3, 2)  # a 2-rank stage-3 checkpoint
    full = torch.load(source / "full_state_dict.pt", weights_only=True)
    out = tmp_path / f"model{suffix}"
    assert main(["consolidate", str(source), str(out)]) == 0  # the command line, no process group
    saved = load_consolidated(out)
    assert list(saved) == list(full)
    for key, value in full.items():
        assert saved[key].dtype == value.dtype and torch.equal(saved[key], value), key
    assert saved["head.weight"] is saved["embed.weight"]  # tied: one tensor, two keys
    manifest = json.loads((source / f"global_step{SAVE_AT}" / "manifest.json").read_text())
    assert manifest["aliases"] == {"head.weight": "embed.weight"}
    if suffix == ".safetensors":
        from safetensors.torch import load_file
        assert "head.weight" not in load_file(out)  # stored once
    else:  # the streamed archive is a valid zip (CRCs filled in)
        import zipfile
        with zipfile.ZipFile(out) as zf:
            assert zf.testzip() is None


# ---------------------------------------------------------------- saving atomically (one rank)

def small_engine(stage: int = 1, model: nn.Module | None = None):
    torch.manual_seed(0)
    return zeromem.initialize(model or BufferedLM(), checkpoint_config(stage, 1))


def params_of(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


CRASH_POINTS = [(point, after) for point in ("_write_rank_file", "_write_client_state",
                                             "write_manifest", "publish", "write_latest")
                for after in (False, True) if (point, after) != ("write_latest", True)]


@pytest.mark.parametrize("point, after", CRASH_POINTS,
                         ids=[f"{'after' if a else 'before'}-{p.strip('_')}"
                              for p, a in CRASH_POINTS])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, point, after):
    engine = small_engine()
    train_global_batch(engine, 0, 1, range(1))
    engine.save_checkpoint(tmp_path, tag="a", client_state={"a": 1})
    expected = params_of(engine)
    train_global_batch(engine, 0, 1, range(1, 2))
    real = getattr(ckpt, point)

    def crash(*args, **kwargs):
        if after:
            real(*args, **kwargs)
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ckpt, point, crash)
    with pytest.raises(CheckpointError, match="injected"):
        engine.save_checkpoint(tmp_path, tag="b", client_state={"b": 2})
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "a"
    assert not (tmp_path / ".tmp-b").exists()
    fresh = small_engine(stage=2)
    path, client = fresh.load_checkpoint(tmp_path)
    assert path.endswith("a") and client == {"a": 1}
    assert all(torch.equal(p, q) for p, q in zip(params_of(fresh), expected))


def test_crash_while_overwriting_a_tag_keeps_it_loadable(tmp_path, monkeypatch):
    engine = small_engine()
    engine.save_checkpoint(tmp_path, tag="a")
    expected = params_of(engine)
    train_global_batch(engine, 0, 1, range(1))
    real_rename, calls = os.rename, []

    def rename(src, dst):  # the second rename (new directory into place) never happens
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("power cut (injected)")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError):
        engine.save_checkpoint(tmp_path, tag="a")
    monkeypatch.undo()
    assert not (tmp_path / "a").exists() and (tmp_path / ".old-a").is_dir()
    fresh = small_engine()
    assert fresh.load_checkpoint(tmp_path)[0].endswith(".old-a")
    assert all(torch.equal(p, q) for p, q in zip(params_of(fresh), expected))
    engine.save_checkpoint(tmp_path, tag="a")  # a later save of that tag cleans up
    assert sorted(os.listdir(tmp_path)) == sorted(["a", "latest", *RECOVERY_SCRIPTS])


def test_stale_temporary_directory_is_replaced(tmp_path):
    (tmp_path / ".tmp-global_step0").mkdir(parents=True)
    (tmp_path / ".tmp-global_step0" / "junk").write_text("left by a crash")
    path = small_engine().save_checkpoint(tmp_path)
    assert sorted(os.listdir(path)) == ["manifest.json", "rank00000.safetensors"]
    assert not (tmp_path / ".tmp-global_step0").exists()


# ---------------------------------------------------------------- bad input (one rank)

def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def disk_snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns,
                                       p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def engine_snapshot(engine) -> list:
    state = [t.clone() for s in engine.optimizer.state.values() for t in s.values()
             if torch.is_tensor(t)]
    return ([g.master.clone() for g in engine.groups] + params_of(engine) + state
            + [torch.tensor([engine.global_steps, engine.micro_steps])])


def assert_same_snapshot(a: list, b: list) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


TAG = f"global_step{SAVE_AT}"
BAD_INPUTS = {
    "missing shard": (lambda d: (d / TAG / "rank00001.safetensors").unlink(), {}, None,
                      r"rank00001.safetensors is missing"),
    "truncated shard": (lambda d: truncate(d / TAG / "rank00000.safetensors"), {}, None,
                        r"rank00000.safetensors is truncated"),
    "corrupted shard": (lambda d: flip_byte(d / TAG / "rank00001.safetensors"), {}, None,
                        r"rank00001.safetensors is corrupted"),
    "corrupted client state": (lambda d: flip_byte(d / TAG / "client_state.pt"), {}, None,
                               r"client_state.pt is corrupted"),
    "other shapes": (None, {"dim": 12}, None, r"parameter '[\w.]+' has shape \[[\d, ]+\] there"),
    "other names": (None, {"extra": True}, None, r"parameter 'extra\.(weight|bias)' is not in it"),
    "unknown tag": (None, {}, "global_step99", r"unknown checkpoint tag 'global_step99'"),
    "no latest": (lambda d: (d / "latest").unlink(), {}, None, r"no 'latest' file"),
    "broken manifest": (lambda d: truncate(d / TAG / "manifest.json"), {}, None,
                        r"manifest.json cannot be read"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_clear_error_and_changes_nothing(worlds, tmp_path, case):
    mutate, model_args, tag, message = BAD_INPUTS[case]
    bad = tmp_path / "ckpt"
    shutil.copytree(case_dir(worlds[0], 2, 2), bad)
    if mutate:
        mutate(bad)
    engine = small_engine(2, BufferedLM(**model_args))
    train_global_batch(engine, 0, 1, range(1))
    disk, state = disk_snapshot(bad), engine_snapshot(engine)
    with pytest.raises(CheckpointError, match=message):
        engine.load_checkpoint(bad, tag=tag)
    assert disk_snapshot(bad) == disk
    assert_same_snapshot(state, engine_snapshot(engine))


def test_optimizer_mismatch_and_skipping_optimizer_states(worlds):
    source = case_dir(worlds[0], 2, 2)
    torch.manual_seed(0)
    sgd = zeromem.initialize(BufferedLM(), {**checkpoint_config(2, 1), "optimizer": {
        "type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    with pytest.raises(CheckpointError, match="adamw states but this engine uses sgd"):
        sgd.load_checkpoint(source)
    sgd.load_checkpoint(source, load_optimizer_states=False)
    full = torch.load(source / "full_state_dict.pt", weights_only=True)
    assert torch.equal(sgd.module.fc1.weight, full["fc1.weight"])
    assert sgd.get_lr() == [pytest.approx(1e-3 + 9e-3 * (SAVE_AT - 1) / 5)]  # the scheduler's state


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offloaded_optimizer_states_round_trip(tmp_path, device):
    """Masters and states offloaded to host or NVMe are saved and loaded like any other."""
    (tmp_path / "swap").mkdir()
    offload = {"offload_optimizer": {"device": device, "nvme_path": str(tmp_path / "swap")}}
    torch.manual_seed(0)
    engine = zeromem.initialize(BufferedLM(), checkpoint_config(2, 1, zero_optimization={
        "stage": 2, "reduce_bucket_size": SAVE_BUCKET, **offload}))
    train_global_batch(engine, 0, 1, range(2))
    engine.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(1)
    plain = small_engine(stage=1)  # no offload, other layout
    plain.load_checkpoint(tmp_path / "ckpt")
    train_global_batch(engine, 0, 1, range(2, 4))
    train_global_batch(plain, 0, 1, range(2, 4))
    assert max((p - q).abs().max().item()
               for p, q in zip(params_of(engine), params_of(plain))) <= 1e-6


def rebuilt_after_load(rank: int, world_size: int, root: str, stage: int) -> list[tuple]:
    """(saver's loss, loaded engine's loss) on this rank's batch, right after the load and
    after one step more; every engine built from a seed of its own on each rank."""
    (Path(root) / "swap").mkdir(exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": str(Path(root) / "swap")}
    zero = {"stage": stage, "reduce_bucket_size": SAVE_BUCKET, **PARTITION_ALL,
            "offload_optimizer": nvme, **({"offload_param": nvme} if stage == 3 else {})}
    config = checkpoint_config(stage, world_size, bf16={"enabled": True}, zero_optimization=zero)
    torch.manual_seed(10 + rank)
    engine = zeromem.initialize(BufferedLM(), config)
    train_global_batch(engine, rank, world_size, range(2))
    engine.save_checkpoint(Path(root) / "ckpt")
    torch.manual_seed(20 + rank)
    loaded = zeromem.initialize(BufferedLM(), config)
    loaded.load_checkpoint(Path(root) / "ckpt")
    tokens, targets = micro_batch(9, rank, 0)
    losses = []
    for step in (2, 3):
        with torch.no_grad():
            losses.append((engine(tokens, targets).item(), loaded(tokens, targets).item()))
        for e in (engine, loaded):
            train_global_batch(e, rank, world_size, [step])
    engine.close()
    loaded.close()
    return losses


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_weights_are_rebuilt_from_masters_loaded_into_nvme(tmp_path, stage):
    """bf16 with the optimizer (stage 3: and the parameters) on NVMe: the masters live in
    optimizer.swp, apart from the bf16 weights, and no step has rebuilt those when a
    checkpoint is loaded. An engine built from other weights evaluates, right after the
    load and a step later, exactly as the one that saved, on every rank."""
    for rank, losses in enumerate(run_distributed(rebuilt_after_load, 2, str(tmp_path), stage)):
        for saver, loaded in losses:
            assert saver == loaded, (rank, losses)


# ---------------------------------------------------------------- consolidate's memory

def test_consolidate_memory_is_bounded_by_the_largest_tensor(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(6)])  # 6 x 16 MiB
    engine = zeromem.initialize(model, {"train_micro_batch_size_per_gpu": 1, "optimizer": {
        "type": "SGD", "params": {"lr": 0.1}}})
    engine.save_checkpoint(tmp_path / "big")
    del engine, model
    largest = 2048 * 2048 * 4
    script = textwrap.dedent("""
        import sys
        import torch, safetensors.torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from zeromem.checkpoints.consolidate import consolidate
        with FakeTensorMode():  # torch's one-time set-up of fake tensors (~70 MiB of code)
            torch.empty(1)
        status = lambda key: int(next(l.split()[1] for l in open("/proc/self/status")
                                      if l.startswith(key))) * 1024
        for out in sys.argv[2:]:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set size (VmHWM)
            before = status("VmRSS:")
            consolidate(sys.argv[1], out)
            print(status("VmHWM:") - before)
    """)
    outs = [tmp_path / "big.safetensors", tmp_path / "big.pt"]
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "big"), *map(str, outs)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for out, peak in zip(outs, map(int, run.stdout.split())):
        print(f"consolidate {out.suffix}: peak +{peak / 2**20:.1f} MiB, largest tensor "
              f"{largest / 2**20:.0f} MiB, model {6 * largest / 2**20:.0f} MiB")
        assert peak <= largest, f"{out.suffix}: peak {peak} bytes > largest tensor {largest}"
        assert out.stat().st_size >= 6 * largest


# ------------------------------------------------ one process (pure logic: unit/test_checkpoint_files.py)


def test_tags_must_be_plain_names(tmp_path):
    engine = small_engine()
    for tag in ("", "../up", ".hidden", "latest"):
        with pytest.raises(CheckpointError, match="plain, non-hidden directory name"):
            engine.save_checkpoint(tmp_path, tag=tag)


