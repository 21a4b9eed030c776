"""Back to FSDP2 (README "Coming from FSDP2"): a zeromem run's checkpoint, written by
`zeromem consolidate CKPT OUT --optimizer` (checkpoints/torch_export.py), continues under
`fully_shard` through torch's own `set_state_dict`, weights, AdamW's moments, step count and
options included: the next losses are the ones zeromem's own continued run gives, on every
rank. The FSDP2 optimizer is built with another learning rate and over every parameter,
frozen ones too, as `torch.optim.AdamW(model.parameters())` is; the file's options and
states must replace its own.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from torch.distributed.fsdp import fully_shard

import zeromem
from harness import run_distributed
from models import TinyLM, micro_batch
from zeromem.cli import main

BEFORE, AFTER = 2, 2


def zeromem_then_fsdp2(rank: int, world_size: int, where: str, stage: int) -> dict:
    torch.manual_seed(0)
    engine = zeromem.initialize(TinyLM(), {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    out: dict = {"zeromem": [], "fsdp2": []}
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            engine.save_checkpoint(f"{where}/ckpt")
        loss = engine(*micro_batch(step, rank, 0))
        loss.backward()
        engine.step()
        out["zeromem"].append(loss.item())
    if rank == 0:
        assert main(["consolidate", f"{where}/ckpt", f"{where}/step-2.pt", "--optimizer"]) == 0
    dist.barrier()
    torch.manual_seed(100 + rank)  # ranks built apart: every value must come from the file
    model = TinyLM()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    saved = torch.load(f"{where}/step-2.pt", weights_only=True)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    for step in range(BEFORE, BEFORE + AFTER):
        loss = model(*micro_batch(step, rank, 0))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["fsdp2"].append(loss.item())
    out["zeromem"] = out["zeromem"][BEFORE:]
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_a_zeromem_checkpoint_continues_under_fsdp2(tmp_path, stage):
    for rank, got in enumerate(run_distributed(zeromem_then_fsdp2, 2, str(tmp_path), stage)):
        diff = max(abs(a - b) for a, b in zip(got["fsdp2"], got["zeromem"]))
        assert diff <= 1e-6, (rank, stage, got)


def test_optimizer_and_hf_outputs_are_one_or_the_other(tmp_path, capsys):
    assert main(["consolidate", str(tmp_path), str(tmp_path / "out"), "--optimizer", "--hf",
                 str(tmp_path)]) == 2
    assert "--optimizer writes one torch file" in capsys.readouterr().err
