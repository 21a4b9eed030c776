"""Coming from FSDP2 (README "Coming from FSDP2"): a run trained with `fully_shard` and saved
with torch.distributed.checkpoint (DCP, torchtitan's format) goes on under zeromem.

The recipe the README gives: torch's own `dcp_to_torch_save` turns the DCP directory into
one file (offline, no process group), every rank loads it into a freshly built module with
`load_state_dict`, and `zeromem.initialize` takes the module from there. The weights are the
FSDP2 run's; optimizer states start afresh, as in a fine-tune from saved weights, so the
test steps a stateless optimizer (SGD without momentum): the next steps' losses must then
be FSDP2's own continued run's, on every rank and at every stage.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard

import zeromem
from harness import run_distributed
from models import TinyLM, micro_batch

BEFORE, AFTER = 2, 2  # steps under FSDP2 before the save, and after it on both systems
LR = 0.1
STAGES = (0, 1, 2, 3)


def fsdp2_run(ckpt: Path) -> list[float]:
    """TinyLM under fully_shard: BEFORE steps, a DCP save, AFTER more steps; their losses."""
    torch.manual_seed(0)
    model = TinyLM()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rank = dist.get_rank()
    losses = []
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(ckpt))
        loss = model(*micro_batch(step, rank, 0))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses[BEFORE:]


def zeromem_run(torch_file: Path, stage: int) -> list[float]:
    """The README's recipe: the converted file into a fresh module, then zeromem."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # ranks built apart: every value must come from the file
    model = TinyLM()
    model.load_state_dict(torch.load(torch_file, weights_only=True)["model"])
    engine = zeromem.initialize(model, {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    losses = []
    for step in range(BEFORE, BEFORE + AFTER):
        loss = engine(*micro_batch(step, rank, 0))
        loss.backward()  # a FSDP2 loop's own backward: the engine's, through its outputs
        engine.step()
        losses.append(loss.item())
    return losses


def switch(rank: int, world_size: int, where: str, stages: tuple[int, ...]) -> dict:
    ckpt = Path(where) / "step-2"
    out = {"fsdp2": fsdp2_run(ckpt)}
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
