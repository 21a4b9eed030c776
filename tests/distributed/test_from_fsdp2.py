"""Coming from FSDP2 (README "Coming from FSDP2"): a run trained with `fully_shard` and saved
with torch.distributed.checkpoint (DCP, torchtitan's format) goes on under zeromem.

torch's own `dcp_to_torch_save` turns the DCP directory into one file (offline, no process
group). The README gives two recipes for it: every rank loads the file's weights into a
freshly built module with `load_state_dict` before `zeromem.initialize` (optimizer states
start afresh: the test steps a stateless SGD), or `engine.load_checkpoint(file)` takes the
weights, the optimizer's states and options and the step count (AdamW, whose moments and
bias correction a wrong import changes, saved as `get_state_dict` names it; SGD with
momentum in torch's flattened layout, as torchtitan saves it, and in the numbered one of
torch's own `optimizer.state_dict()`). `engine.load_checkpoint` reads the DCP directory itself
too, without running its pickles (checkpoints/dcp_read.py), and the two folders Accelerate's
FSDP `save_state` writes. Either way the next steps' losses must be FSDP2's own continued
run's, on every rank and at every stage.
"""
from __future__ import annotations

import io
from functools import partial
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict)
from torch.distributed.fsdp import fully_shard

import zeromem
from harness import run_distributed
from models import TinyLM, decay_groups, micro_batch, unclipped_config

BEFORE, AFTER = 2, 2  # steps under FSDP2 before the save, and after it on both systems
LR = 0.1
STAGES = (0, 1, 2, 3)


def fsdp2_run(ckpt: Path, make_optimizer: Callable, saved: Callable,
              make_schedule: Callable | None = None) -> list[float]:
    """TinyLM under fully_shard: BEFORE steps, DCP saves of `saved(model, optimizer)` (state
    dicts by folder under `ckpt`: "." is `ckpt` itself; a `.bin` name: a torch file rank 0
    writes), AFTER more steps; their losses. `make_schedule(optimizer)`: an lr schedule
    stepped after each optimizer step."""
    torch.manual_seed(0)
    model = TinyLM()
    fully_shard(model)
    opt = make_optimizer(model.parameters())
    schedule = make_schedule(opt) if make_schedule is not None else None
    rank = dist.get_rank()
    losses = []
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            for folder, state in saved(model, opt).items():
                if not folder.endswith(".bin"):
                    dcp.save(state, checkpoint_id=str(ckpt / folder))
                elif rank == 0:  # a torch file of the full state dict
                    ckpt.mkdir(parents=True, exist_ok=True)
                    torch.save(state, ckpt / folder)
            dist.barrier()
        loss = model(*micro_batch(step, rank, 0))
        loss.backward()
        opt.step()
        if schedule is not None:
            schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses[BEFORE:]


def zeromem_run(torch_file: Path, stage: int) -> list[float]:
    """The README's recipe: the converted file into a fresh module, then zeromem."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # ranks built apart: every value must come from the file
    model = TinyLM()
    model.load_state_dict(torch.load(torch_file, weights_only=True)["model"])
    engine = zeromem.initialize(model, unclipped_config(stage, 4, {"type": "SGD",
                                                                   "params": {"lr": LR}}))
    losses = []
    for step in range(BEFORE, BEFORE + AFTER):
        loss = engine(*micro_batch(step, rank, 0))
        loss.backward()  # a FSDP2 loop's own backward: the engine's, through its outputs
        engine.step()
        losses.append(loss.item())
    return losses


def switch(rank: int, world_size: int, where: str, stages: tuple[int, ...]) -> dict:
    ckpt = Path(where) / "step-2"
    out = {"fsdp2": fsdp2_run(ckpt, lambda params: torch.optim.SGD(params, lr=LR),
                              lambda model, _: {".": {"model": get_model_state_dict(model)}})}
    torch_file = Path(where) / "model.pt"
    if rank == 0:
        dcp_to_torch_save(ckpt, torch_file)
    dist.barrier()
    for stage in stages:
        out[stage] = zeromem_run(torch_file, stage)
    return out


def test_fsdp2_dcp_checkpoint_continues_under_zeromem(tmp_path):
    for rank, got in enumerate(run_distributed(switch, 2, str(tmp_path), STAGES)):
        for stage in STAGES:
            diff = max(abs(a - b) for a, b in zip(got[stage], got["fsdp2"]))
            assert diff <= 1e-6, (rank, stage, got[stage], got["fsdp2"])


# the FSDP2 run's optimizer, and the zeromem config's block, whose options the file's replace
OPTIMIZERS = {
    "adamw": (lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
              {"type": "AdamW", "params": {"lr": 0.5}}),
    "sgd": (lambda params: torch.optim.SGD([p for p in params if p.requires_grad], lr=LR,
                                           momentum=0.9),  # the trained ones only
            {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.5}}),
}


def layout_state(layout: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What the run saves: "nested" (`get_state_dict`), "torchtitan" (flattened, the model's
    keys at the top, its train state), "numbered" (`model.state_dict()`, `opt.state_dict()`)
    or "accelerate" (nested, in the two folders Accelerate's FSDP `save_state` writes, or,
    "accelerate_full", the two files it writes with FULL_STATE_DICT)."""
    if layout == "numbered":
        return {".": {"model": model.state_dict(), "optimizer": opt.state_dict()}}
    options = StateDictOptions(flatten_optimizer_state_dict=layout == "torchtitan")
    msd, osd = get_state_dict(model, opt, options=options)
    if layout == "torchtitan":  # its step, and a byte entry as older versions have
        return {".": {**msd, "optimizer": osd, "train_state": {
            "step": torch.tensor(BEFORE, dtype=torch.int32), "log_steps": io.BytesIO(b"x")}}}
    if layout == "accelerate":  # accelerate/utils/fsdp_utils.py save_fsdp_model / _optimizer
        return {"pytorch_model_fsdp_0": {"model": msd}, "optimizer_0": {"optimizer": osd}}
    if layout == "accelerate_full":  # the same, with StateDictType.FULL_STATE_DICT
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        return {"pytorch_model_fsdp.bin": msd, "optimizer.bin": osd}
    return {".": {"model": msd, "optimizer": osd}}


def resumed_run(torch_file: Path, stage: int | str, kind: str, layout: str,
                tag: str | None = None) -> list[float]:
    """`engine.load_checkpoint` of the converted file or of the DCP directory itself, then the
    same steps (stage "nvme": 3 with optimizer and parameters on NVMe, whose states the load
    writes to disk)."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    nvme = {"device": "nvme", "nvme_path": str(torch_file.parent)}
    offload = {"offload_optimizer": nvme, "offload_param": nvme} if stage == "nvme" else {}
    engine = zeromem.initialize(TinyLM(), unclipped_config(
        3 if stage == "nvme" else int(stage), 4, OPTIMIZERS[kind][1], **offload))
    engine.load_checkpoint(str(torch_file), tag=tag)
    # Adam's step, torchtitan's trainer's, or none (SGD)
    assert engine.global_steps == (0 if (kind, layout) == ("sgd", "numbered") else BEFORE)
    losses = []
    for step in range(BEFORE, BEFORE + AFTER):
        loss = engine(*micro_batch(step, rank, 0))
        loss.backward()
        engine.step()
        losses.append(loss.item())
    return losses


def resume(rank: int, world_size: int, where: str, kind: str, layout: str,
           stages: tuple[int | str, ...]) -> dict:
    ckpt = Path(where) / "step-2"
    out = {"fsdp2": fsdp2_run(ckpt, OPTIMIZERS[kind][0], partial(layout_state, layout))}
    torch_file = Path(where) / "step-2.pt"
    if rank == 0 and stages:
        dcp_to_torch_save(ckpt, torch_file)
    dist.barrier()
    for stage in stages:
        out[stage] = resumed_run(torch_file, stage, kind, layout)
    # the directory as the run saved it (torchtitan's: its checkpoint folder and step's tag)
    out["dcp"] = resumed_run(ckpt.parent, 3, kind, layout, tag=ckpt.name) \
        if layout == "torchtitan" else resumed_run(ckpt, 3, kind, layout)
    return out


@pytest.mark.parametrize("kind, layout, stages", [("adamw", "nested", (*STAGES, "nvme")),
                                                  ("sgd", "torchtitan", (1, 3)),
                                                  ("sgd", "numbered", (0, 3)),
                                                  ("adamw", "accelerate", ()),
                                                  ("adamw", "accelerate_full", ())])
def test_fsdp2_run_resumes_with_its_optimizer_states(tmp_path, kind, layout, stages):
    for rank, got in enumerate(run_distributed(resume, 2, str(tmp_path), kind, layout,
                                               stages)):
        for stage in (*stages, "dcp"):
            diff = max(abs(a - b) for a, b in zip(got[stage], got["fsdp2"]))
            assert diff <= 1e-6, (rank, stage, got[stage], got["fsdp2"])


def warmup(step: int) -> float:
    """LambdaLR's factor: a warmup over 4 steps, so the step a schedule stands at shows."""
    return min(1.0, (step + 1) / 4)


def scheduled(rank: int, world_size: int, where: str) -> dict:
    """AdamW under a LambdaLR warmup in FSDP2 and, with the same schedule and lr, in zeromem
    (stage 3), resumed from the DCP directory: the schedule goes on from step BEFORE."""
    ckpt = Path(where) / "step-2"
    out = {"fsdp2": fsdp2_run(ckpt, lambda params: torch.optim.AdamW(params, lr=0.01),
                              partial(layout_state, "nested"),
                              lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))}
    torch.manual_seed(100 + rank)
    engine = zeromem.initialize(
        TinyLM(), unclipped_config(3, 4, {"type": "AdamW", "params": {"lr": 0.01}}),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    engine.load_checkpoint(str(ckpt))
    out["lr"] = engine.get_lr()
    out["zeromem"] = []
    for step in range(BEFORE, BEFORE + AFTER):
        loss = engine(*micro_batch(step, rank, 0))
        loss.backward()
        engine.step()
        out["zeromem"].append(loss.item())
    return out


def test_an_imported_run_goes_on_with_its_lr_schedule(tmp_path):
    for rank, got in enumerate(run_distributed(scheduled, 2, str(tmp_path))):
        assert got["lr"] == pytest.approx([0.01 * warmup(BEFORE)]), got["lr"]
        diff = max(abs(a - b) for a, b in zip(got["zeromem"], got["fsdp2"]))
        assert diff <= 1e-6, (rank, got["zeromem"], got["fsdp2"])


def gpt2_tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))


def gpt2_resume(rank: int, world_size: int, where: str) -> dict:
    """Hugging Face's GPT-2 (tied head) with its two param groups, one unit per block under
    FSDP2, saved with DCP (named by get_state_dict, and numbered as `opt.state_dict()` has
    them); resumed through `load_checkpoint` with the same groups."""
    from setups import hf_tiny_builders
    build = hf_tiny_builders(vocab=64, seq=16)["gpt2"]
    torch.manual_seed(0)
    model = build()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(decay_groups(model), lr=0.01)
    out: dict = {"fsdp2": []}
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=f"{where}/gpt2")
            # as nanoGPT's and a DDP script's torch.save have it: the groups numbered
            dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                     checkpoint_id=f"{where}/gpt2-numbered")
        tokens = gpt2_tokens(step, rank)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["fsdp2"].append(loss.item())
    out["fsdp2"] = out["fsdp2"][BEFORE:]
    if rank == 0:
        dcp_to_torch_save(f"{where}/gpt2", f"{where}/gpt2.pt")
    dist.barrier()
    for stage, source in ((2, "gpt2.pt"), (3, "gpt2.pt"), ("numbered", "gpt2-numbered")):
        out[stage] = gpt2_resumed(build, f"{where}/{source}", 3 if stage == "numbered" else stage)
    return out


def gpt2_resumed(build: Callable, source: str, stage: int) -> list[float]:
    """A fresh GPT-2 under zeromem, given the saving run's groups, resumed from `source`."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    fresh = build()
    engine = zeromem.initialize(fresh, unclipped_config(stage, 2, OPTIMIZERS["adamw"][1]),
                                model_parameters=decay_groups(fresh))
    engine.load_checkpoint(source)
    losses = []
    for step in range(BEFORE, BEFORE + AFTER):
        tokens = gpt2_tokens(step, rank)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_hugging_face_gpt2_with_two_param_groups_resumes(tmp_path):
    for rank, got in enumerate(run_distributed(gpt2_resume, 2, str(tmp_path))):
        for stage in (2, 3, "numbered"):
            diff = max(abs(a - b) for a, b in zip(got[stage], got["fsdp2"]))
            assert diff <= 1e-5, (rank, stage, got[stage], got["fsdp2"])
