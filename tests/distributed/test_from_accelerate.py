"""Coming from Accelerate or the Hugging Face Trainer without DeepSpeed: the folder
`accelerator.save_state` writes (a model file beside the optimizer's own numbered
`state_dict()`), and the Trainer's `checkpoint-N`, go on under zeromem through
`engine.load_checkpoint(folder)`.

The saving runs are Accelerate's and the Trainer's own, under torchrun (DDP on this CPU):
accelerate_save_state_script.py (TinyLM, AdamW over decay / no-decay groups; the next
losses must be Accelerate's own continued run's, on every rank, at stages 0 and 3) and
hf_trainer_checkpoint_script.py (a tiny GPT-2, the Trainer's own AdamW and groups; the
weights and Adam moments zeromem holds after the load must be the checkpoint's files',
the moments mapped by the Trainer's own numbering). zeromem is given the same groups, its
config another lr (the checkpoint's must win).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeromem
from harness import run_distributed
from launch import torchrun
from models import TinyLM, decay_groups, micro_batch, unclipped_config

pytest.importorskip("accelerate")
SCRIPT = Path(__file__).with_name("accelerate_save_state_script.py")
TRAINER = Path(__file__).with_name("hf_trainer_checkpoint_script.py")
SAVE_AT, AFTER = 2, 2
STAGES = (0, 3)
ADAMW = {"type": "AdamW", "params": {"lr": 0.5}}  # not the saving runs' lr: theirs must win


def resume(rank: int, world_size: int, state: str) -> dict:
    out = {}
    for stage in STAGES:
        torch.manual_seed(100 + rank)  # ranks built apart: every value must come from the files
        model = TinyLM()
        engine = zeromem.initialize(model, unclipped_config(stage, 4, ADAMW),
                                    model_parameters=decay_groups(model))
        engine.load_checkpoint(state)
        assert engine.global_steps == SAVE_AT, engine.global_steps  # Adam's step count
        losses = []
        for step in range(SAVE_AT, SAVE_AT + AFTER):
            loss = engine(*micro_batch(step, dist.get_rank(), 0))
            loss.backward()
            engine.step()
            losses.append(loss.item())
        out[stage] = losses
    return out


def test_accelerate_save_state_continues_under_zeromem(tmp_path):
    torchrun(SCRIPT, "run", tmp_path, reference_outputs=(tmp_path / "losses_0.json",
                                                         tmp_path / "losses_1.json"))
    assert sorted(p.name for p in (tmp_path / "state").iterdir())[:2] == [
        "model.safetensors", "optimizer.bin"]  # Accelerate's layout, as this test reads it
    for rank, got in enumerate(run_distributed(resume, 2, str(tmp_path / "state"))):
        theirs = json.loads((tmp_path / f"losses_{rank}.json").read_text())
        for stage in STAGES:
            diff = max(abs(a - b) for a, b in zip(got[stage], theirs))
            assert diff <= 1e-6, (rank, stage, got[stage], theirs)


def trainer_checkpoint(rank: int, world_size: int, out: str) -> dict:
    """zeromem (stage 3, the same groups) loads the Trainer's checkpoint-2; its weights and
    Adam moments against the checkpoint's own files, the moments mapped by the Trainer's
    numbering (its decay names, then the rest, each in the model's order)."""
    import transformers
    from safetensors.torch import load_file

    from zeromem.param_states import MASTER
    ckpt = Path(out) / "checkpoint-2"
    model = transformers.GPT2LMHeadModel.from_pretrained(Path(out) / "init")
    decay = transformers.Trainer.get_decay_parameter_names(None, model)  # no `self` used
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    order = [n for n, _ in named if n in decay] + [n for n, _ in named if n not in decay]
    engine = zeromem.initialize(model, unclipped_config(3, 2, ADAMW),
                                model_parameters=decay_groups(model))
    engine.load_checkpoint(str(ckpt))
    weights = load_file(ckpt / "model.safetensors")
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    params, states = dict(named), engine.param_states  # whole tensors, collective
    return {"steps": engine.global_steps, "lr": engine.get_lr(),
            "weights": max((states.full(params[n], MASTER) - weights[n]).abs().max().item()
                           for n in params),
            "exp_avg": max((states.full(params[n], "exp_avg")
                            - saved["state"][i]["exp_avg"]).abs().max().item()
                           for i, n in enumerate(order)),
            "changed": max((states.full(params[n], MASTER) - w).abs().max().item()
                           for n, w in load_file(Path(out) / "init" / "model.safetensors").items()
                           if n in params)}


def test_hugging_face_trainer_checkpoint_loads_with_its_optimizer(tmp_path):
    torchrun(TRAINER, "run", tmp_path, reference_outputs=(tmp_path / "checkpoint-2",))
    for got in run_distributed(trainer_checkpoint, 2, str(tmp_path)):
        assert got["steps"] == 2 and got["lr"] == [1e-2, 1e-2], got  # Adam's step, its lr
        assert got["weights"] == 0.0 and got["exp_avg"] == 0.0, got
        assert got["changed"] > 0, got  # the checkpoint's weights are not the initial ones

