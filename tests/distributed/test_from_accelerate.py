"""Coming from Accelerate or the Hugging Face Trainer without DeepSpeed: the folder
`accelerator.save_state` writes (a model file beside the optimizer's own numbered
`state_dict()`) goes on under zeromem through `engine.load_checkpoint(folder)`.

The saving run is Accelerate's own (accelerate_save_state_script.py under torchrun: DDP
on this CPU), AdamW over Hugging Face's decay / no-decay groups; zeromem is given the same
groups, its config another lr (the file's must win). The next losses must be Accelerate's
own continued run's, on every rank, at stages 0 and 3.
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
from models import TinyLM, decay_groups, micro_batch

pytest.importorskip("accelerate")
SCRIPT = Path(__file__).with_name("accelerate_save_state_script.py")
SAVE_AT, AFTER = 2, 2
STAGES = (0, 3)


def resume(rank: int, world_size: int, state: str) -> dict:
    out = {}
    for stage in STAGES:
        torch.manual_seed(100 + rank)  # ranks built apart: every value must come from the files
        model = TinyLM()
        engine = zeromem.initialize(model, {
            "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
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
