"""The NVMe optimizer's step begun in the boundary backward (offload/backward_step.py).

fp32 or bf16, stage 3, optimizer and parameters on NVMe: each sub-group is stepped as
soon as its gradient is reduced (with clipping, a guess that the step is not clipped,
redone from the kept gradients when it is). Every check compares it, bitwise, with the
same engine stepping in step() (`zeromem.nvme_step_in_backward: false`): parameters,
optimizer states and the global norm, through a learning-rate schedule, an evaluation
before the first step, a non-finite gradient on one rank (the step skipped on both,
as DeepSpeed 0.19 skips it for fp32 and bf16), gradient accumulation, a
checkpoint saved after a step and loaded, and gradients arriving out of order.
"""
from __future__ import annotations

import copy
import errno
import math
import os
from pathlib import Path

import pytest
import torch

import zeromem
from harness import run_distributed
from models import TinyLM, micro_batch
from setups import parity_config, slow_disk, slow_writes
from zeromem.offload.nvme import OffloadError

CLIP = 50.0  # between the gradient norms of the loss as it is and scaled by 1e4
CLIP_SCALES = (1.0, 1e4, 1.0, 1.0)  # step 1 is clipped
SCHEDULE = {"type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}}


def build(model: torch.nn.Module, path: str, world_size: int, gas: int, in_backward: bool,
          buffers: int = 12, clip: float = 0.0, bf16: bool = False):
    """`buffers`: offload_optimizer.buffer_count, 4 buffers a sub-group (master, 2 states,
    gradient): 12 keep 3 sub-groups in flight."""
    cfg = parity_config(3, gas, clip, world_size, scheduler=SCHEDULE, bf16={"enabled": bf16},
                        zeromem={"nvme_step_in_backward": in_backward})
    cfg["zero_optimization"].update(
        {"sub_group_size": 37,  # sub-groups cut shards inside a block: shared blocks
         "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": buffers},
         "offload_param": {"device": "nvme", "nvme_path": path, "buffer_count": 2}})
    return zeromem.initialize(model, cfg)


def snapshot(engine) -> list[torch.Tensor]:
    """Parameters and optimizer states, in a fixed order."""
    with engine.offload.all_in_memory():
        full = engine.full_state_dict()
        states = engine.optimizer.state_dict()["state"]
        out = [full[k].clone() for k in sorted(full)]
        for key in sorted(states):
            out += [v.clone() for _, v in sorted(states[key].items()) if torch.is_tensor(v)]
    return out


def poison_last_put(engine, rank: int) -> list[bool]:
    """While the returned flag is set, rank 1's last group's reduced shard gets a NaN."""
    flag = [False]
    grads = engine.optimizer.grad_file
    put, last = grads.put, engine.groups[-1]

    def poisoned(group, raw, shard):
        if flag[0] and rank == 1 and group is last:
            shard[0] = float("nan")
        put(group, raw, shard)

    grads.put = poisoned
    return flag


def hold_back(engine) -> None:
    """Deliver each even group's reduced shard after the next group's: gradients out of
    the order `Comm.reduce_in_order` gives them, so sub-groups wait half-filled for a slot."""
    grads, groups = engine.optimizer.grad_file, engine.groups
    put, held = grads.put, []

    def late_put(group, raw, shard):
        if not held and groups.index(group) % 2 == 0 and group is not groups[-1]:
            held.append((group, raw, shard))
            return
        put(group, raw, shard)
        while held:
            put(*held.pop())

    grads.put = late_put


def train(engine, step: int, rank: int, gas: int, scale: float = 1.0) -> dict:
    """One step (the loss times `scale`); what the run report says of it (grads.swp: the
    snapshots between steps read no gradient) and the bytes of optimizer.swp moved in it."""
    states = next(f for s in engine.offload.spaces for f in s.files
                  if f.path.name == "optimizer.swp")
    moved = states.read_bytes, states.written_bytes
    for micro in range(gas):
        tokens, targets = micro_batch(step, rank, micro)
        engine.backward(engine(tokens, targets, (step + micro) % 3 != 0) * scale)
        if micro == gas - 1:
            stepped = list(engine.optimizer.in_backward.stepped) \
                if engine.optimizer.in_backward is not None else []
        engine.step()
    io = engine.offload.io_report()["last_step"]
    return {"stepped_before_step": len(stepped), "grads_swp": io["files"].get("grads.swp"),
            "optimizer_swp": [states.read_bytes - moved[0], states.written_bytes - moved[1]],
            "in_backward": io["in_backward"], "norm": engine.get_global_grad_norm()}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def same_norm(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and not math.isfinite(a)
                      and not math.isfinite(b))


def backward_step_run(rank: int, world_size: int, path: str) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    out: dict = {}
    # gradient accumulation 1: a schedule, an evaluation first, a NaN on one rank at step 2
    early = build(copy.deepcopy(model), path, world_size, 1, True)
    late = build(copy.deepcopy(model), path, world_size, 1, False)
    out["sub_groups"] = len(early.optimizer.sub_groups)
    out["record_bytes"] = early.optimizer.layout.file_bytes  # one copy of optimizer.swp
    tokens, targets = micro_batch(99, rank, 0)
    with torch.no_grad():
        out["eval_same"] = torch.equal(early(tokens, targets), late(tokens, targets))
    flags = [poison_last_put(e, rank) for e in (early, late)]
    out["steps"] = []
    for step in range(4):
        for flag in flags:
            flag[0] = step == 2
        before = snapshot(early)
        rows = [train(e, step, rank, 1) for e in (early, late)]
        after = snapshot(early)
        out["steps"].append({"early": rows[0], "late": rows[1], "same": same(after, snapshot(late)),
                             "norm_same": same_norm(rows[0]["norm"], rows[1]["norm"]),
                             "unchanged": same(before, after)})
    out["skipped"] = (early.skipped_steps, late.skipped_steps)
    # a checkpoint saved after a step loads to the same states; the next step stays the same
    early.save_checkpoint(Path(path) / "ckpt")
    loaded = build(TinyLM(), path, world_size, 1, True)
    loaded.load_checkpoint(Path(path) / "ckpt")
    for e in (early, late, loaded):
        train(e, 4, rank, 1)
    out["loaded_same"] = same(snapshot(loaded), snapshot(late)) and \
        same(snapshot(early), snapshot(late))
    # between the backward that began the step and step(): no whole read, no new settings
    tokens, targets = micro_batch(5, rank, 0)
    early.backward(early(tokens, targets))
    with pytest.raises(OffloadError, match="between a boundary backward"):
        with early.offload.all_in_memory():
            pass
    early.optimizer.param_groups[0]["lr"] *= 0.5
    with pytest.raises(OffloadError, match="changed between"):
        early.step()
    for e in (early, late, loaded):
        e.close()
    # gradient accumulation 2: only the boundary micro-step steps; the first goes to grads.swp
    early = build(copy.deepcopy(model), path, world_size, 2, True)
    late = build(copy.deepcopy(model), path, world_size, 2, False)
    out["accumulated"] = []
    for step in range(2):
        rows = [train(e, step, rank, 2) for e in (early, late)]
        out["accumulated"].append({"early": rows[0], "late": rows[1],
                                   "same": same(snapshot(early), snapshot(late)),
                                   "norm_same": rows[0]["norm"] == rows[1]["norm"]})
    for e in (early, late):
        e.close()
    # bf16: the fp32 masters in optimizer.swp, the new 16-bit values written to params.swp's
    # other copy; a NaN on rank 1 at step 1 skips the step, both files as they were; a
    # checkpoint saved after a step loads exact
    early = build(copy.deepcopy(model), path, world_size, 1, True, bf16=True)
    late = build(copy.deepcopy(model), path, world_size, 1, False, bf16=True)
    flags = [poison_last_put(e, rank) for e in (early, late)]
    out["bf16"] = []
    for step in range(3):
        for flag in flags:
            flag[0] = step == 1
        rows = [train(e, step, rank, 1) for e in (early, late)]
        out["bf16"].append({"early": rows[0], "same": same(snapshot(early), snapshot(late)),
                            "norm_same": same_norm(rows[0]["norm"], rows[1]["norm"])})
    out["bf16_skipped"] = early.skipped_steps
    early.save_checkpoint(Path(path) / "ckpt16")  # and loaded: the next step stays the same
    loaded = build(TinyLM(), path, world_size, 1, True, bf16=True)
    loaded.load_checkpoint(Path(path) / "ckpt16")
    for e in (early, late, loaded):
        train(e, 3, rank, 1)
    out["bf16_loaded_same"] = same(snapshot(loaded), snapshot(late)) and \
        same(snapshot(early), snapshot(late))
    for e in (early, late, loaded):
        e.close()
    # bf16 with accumulation 2 and clipping: the boundary's sum stepped in backward, the
    # clipped step's guess redone (its 16-bit values written again, from step())
    early = build(copy.deepcopy(model), path, world_size, 2, True, clip=CLIP, bf16=True)
    late = build(copy.deepcopy(model), path, world_size, 2, False, clip=CLIP, bf16=True)
    out["bf16_clipped"] = []
    for step, scale in enumerate(CLIP_SCALES[:3]):
        rows = [train(e, step, rank, 2, scale) for e in (early, late)]
        out["bf16_clipped"].append({"early": rows[0], "same": same(snapshot(early), snapshot(late)),
                                    "norm_same": rows[0]["norm"] == rows[1]["norm"]})
    for e in (early, late):
        e.close()
    # gradient clipping: stepped in backward while the last step was not clipped, its
    # gradients kept; a clipped step (the loss scaled up at step 1) is redone from them
    early = build(copy.deepcopy(model), path, world_size, 1, True, clip=CLIP)
    late = build(copy.deepcopy(model), path, world_size, 1, False, clip=CLIP)
    out["clipping"] = []
    for step, scale in enumerate(CLIP_SCALES):
        rows = [train(e, step, rank, 1, scale) for e in (early, late)]
        out["clipping"].append({"early": rows[0], "late": rows[1],
                                "same": same(snapshot(early), snapshot(late)),
                                "norm_same": rows[0]["norm"] == rows[1]["norm"]})
    for e in (early, late):
        e.close()
    # out of order, one sub-group in flight: those with no slot free go through grads.swp
    early = build(copy.deepcopy(model), path, world_size, 1, True, buffers=4)
    late = build(copy.deepcopy(model), path, world_size, 1, False, buffers=4)
    hold_back(early)
    out["out_of_order"] = []
    for step in range(2):
        rows = [train(e, step, rank, 1) for e in (early, late)]
        out["out_of_order"].append({"early": rows[0], "same": same(snapshot(early), snapshot(late))})
    # on a slow disk: the reads into slots just stepped start behind their writes
    # reads into a slot wait for its write (SwapFile.read(after=))
    with slow_writes(lambda name: 0.01):
        for step in range(2, 4):
            for e in (early, late):
                train(e, step, rank, 1)
    # slow reads: a sub-group whose gradient is in waits for its reads to be stepped
    with slow_disk(lambda op, name: 0.005 * (name == "optimizer.swp")):
        for step in range(4, 6):
            for e in (early, late):
                train(e, step, rank, 1)
    out["slow_disk_same"] = same(snapshot(early), snapshot(late))
    for e in (early, late):
        e.close()
    return out


def test_step_in_backward_is_bitwise_the_step_in_step(tmp_path):
    """Every sub-group is stepped in the boundary backward (grads.swp neither written nor
    read), with results bitwise equal to stepping in step(); a NaN on rank 1's last
    gradient, after rank 0 had stepped all of its sub-groups, skips the step on both
    ranks and leaves every state as it was; accumulation writes the first micro-step's
    gradient only; a checkpoint after a step loads exact; whole reads and new settings
    between backward and step() are refused; gradients out of order leave some
    sub-groups to step(), through grads.swp, with the same results; on a slow disk too;
    with clipping, a clipped step's guess is redone and the next one not guessed; in
    bf16, all in backward too, a skip and a checkpoint included."""
    for out in run_distributed(backward_step_run, 2, str(tmp_path)):
        n = out["sub_groups"]
        assert n >= 3 and out["eval_same"], out
        for step, row in enumerate(out["steps"]):
            assert row["same"] and row["norm_same"], (step, row)
            early, late = row["early"], row["late"]
            assert late["stepped_before_step"] == 0 and late["grads_swp"][1] > 0, row
            assert early["stepped_before_step"] > 0, row  # rank 0: all, rank 1: all but one
            if step == 2:  # skipped: nothing changed, though sub-groups were stepped
                assert row["unchanged"] and not math.isfinite(early["norm"]), row
                continue
            assert not row["unchanged"] and math.isfinite(early["norm"]), row
            # all in backward: the last ones, whose reads ran on as backward ended, at step()
            assert early["in_backward"] == n >= early["stepped_before_step"] > n // 2, row
            assert early["grads_swp"] == [0, 0], row  # no gradient written nor read back
            if step:  # each record read once (none read for a guess that came wrong), written once
                assert early["optimizer_swp"] == [out["record_bytes"]] * 2, row
        assert out["skipped"] == (1, 1), out["skipped"]
        assert out["loaded_same"]
        for row in out["accumulated"]:
            assert row["same"] and row["norm_same"], row
            assert row["early"]["in_backward"] == n, row
            # the first micro-step's gradients written; the boundary's sum never read back
            assert row["early"]["grads_swp"][1] > 0, row
            assert row["early"]["grads_swp"][0] < row["late"]["grads_swp"][0], row
        assert out["slow_disk_same"]
        for step, row in enumerate(out["clipping"]):
            early, clipped = row["early"], CLIP_SCALES[step] > 1
            assert row["same"] and row["norm_same"], (step, row)
            assert (early["norm"] > CLIP) == clipped, (step, row)  # the case meant
            # a guess each step but the one after the clipped step
            assert (early["stepped_before_step"] > 0) == (step != 2), (step, row)
            # a right guess steps all in backward; a wrong one none (redone in step())
            assert early["in_backward"] == (0 if clipped or step == 2 else n), (step, row)
            assert early["grads_swp"][1] > 0, (step, row)  # kept, to redo a wrong guess
            assert (early["grads_swp"][0] > 0) == (clipped or step == 2), (step, row)
        for step, row in enumerate(out["bf16"]):
            assert row["same"] and row["norm_same"], (step, row)
            if step != 1:  # step 1 skipped
                assert row["early"]["in_backward"] == n and row["early"]["grads_swp"] == [0, 0], row
        assert out["bf16_skipped"] == 1 and out["bf16_loaded_same"]
        for step, row in enumerate(out["bf16_clipped"]):
            assert row["same"] and row["norm_same"], (step, row)
            assert (row["early"]["norm"] > CLIP) == (step == 1), (step, row)  # the case meant
            assert row["early"]["in_backward"] == (n if step == 0 else 0), (step, row)
        for row in out["out_of_order"]:
            assert row["same"], row
            assert 0 < row["early"]["in_backward"] < n and row["early"]["grads_swp"][1] > 0, row


def test_a_failed_read_in_backward_fails_the_step_and_every_later_one(tmp_path, monkeypatch):
    """A read of optimizer.swp that fails in the backward that began the step is raised
    there, naming the file; no later step runs on the half-written states."""
    torch.manual_seed(0)
    engine = build(TinyLM(), str(tmp_path), 1, 1, True)
    train(engine, 0, 0, 1)
    preadv = os.preadv

    def failing(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("optimizer.swp"):
            raise OSError(errno.EIO, "Input/output error")
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(OffloadError, match="EIO") as info:
        train(engine, 1, 0, 1)
    assert "optimizer.swp" in str(info.value)
    monkeypatch.undo()
    with pytest.raises(OffloadError, match="failed earlier"):
        train(engine, 2, 0, 1)
    engine.close()
