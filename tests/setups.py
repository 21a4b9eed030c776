"""Configs and training loops that several test files share (models are in models.py)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

import zeromem
from models import TinyLM, micro_batch, uses_sometimes

# Checkpoint tests: G micro-batches per optimizer step whatever the world size, so runs of
# different world sizes train on exactly the same data.
G = 4
SAVE_BUCKET = 100

# Stage 3 keeps units under the threshold (default 100k elements: all of BufferedLM) whole;
# 0 partitions every unit, so stage-3 saves and loads really see parameter shards.
PARTITION_ALL = {"stage3_param_persistence_threshold": 0}


def parity_config(stage: int, gas: int, clip: float, world_size: int, overlap: bool | None = None,
                  **extra) -> dict:
    # stage 3: persistence threshold 0 so every parameter of this tiny model is partitioned;
    # overlap None: DeepSpeed's default (async buckets at stage 3 only)
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        # tiny buckets: several reduce buckets and chunked all-gathers on this tiny model
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                              "allgather_bucket_size": 50,
                              "stage3_param_persistence_threshold": 0,
                              "overlap_comm": overlap},
        **extra,
    }


def build_tiny_lm(use_init: bool) -> TinyLM:
    """TinyLM from seed 0, built whole or already partitioned under zeromem.Init."""
    torch.manual_seed(0)
    if not use_init:
        return TinyLM()
    with zeromem.Init():
        return TinyLM()


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, world_size: int,
                   **kwargs) -> list[float]:
    """One AdamW step on the global batch; unreached parameters get zero gradients, as in ZeRO."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    losses = []
    for r in range(world_size):
        loss = model(*micro_batch(step, r, 0), **kwargs)
        (loss / world_size).backward()
        losses.append(loss.item())
    opt.step()
    return losses  # per rank's micro-batch


def checkpoint_config(stage: int, world_size: int, bucket: int = SAVE_BUCKET, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": G // world_size,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 5,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                              "allgather_bucket_size": 50, **PARTITION_ALL},
        **extra,
    }


def train_global_batch(engine, rank: int, world_size: int, steps) -> None:
    """Rank r runs micro-batches r*gas .. r*gas+gas-1 of each global batch of G."""
    gas = G // world_size
    for step in steps:
        for micro in range(gas):
            j = rank * gas + micro
            tokens, targets = micro_batch(step, j, 0)
            # Same on every rank: stage 3 with partitioned units gathers each module collectively.
            engine.backward(engine(tokens, targets, uses_sometimes(step, j, 0, per_rank=False)))
            engine.step()


# DeepSpeed checkpoints (tests/data/deepspeed_checkpoints, made by tools/make_deepspeed_checkpoints.py):
# each case directory holds DeepSpeed's checkpoint and expected.json (its config and its loss curve
# after the save, one loss per micro-batch j of G per step).
DEEPSPEED_CHECKPOINTS = Path(__file__).parent / "data" / "deepspeed_checkpoints"


def deepspeed_case(name: str) -> tuple:
    """(checkpoint directory, expected.json contents) of one DeepSpeed checkpoint case."""
    path = DEEPSPEED_CHECKPOINTS / name
    return path, json.loads((path / "expected.json").read_text())


def deepspeed_resume_config(expected: dict, stage: int, world_size: int) -> dict:
    """The DeepSpeed run's config for a zeromem run at `stage` on `world_size` ranks."""
    config = copy.deepcopy(expected["config"])
    config["gradient_accumulation_steps"] = expected["micro_batches_per_step"] // world_size
    config["zero_optimization"]["stage"] = stage
    return config


def deepspeed_curve(engine, rank: int, world_size: int, expected: dict) -> list[list[float]]:
    """This rank's losses over the steps DeepSpeed recorded after its save: [step][micro]."""
    gas = expected["micro_batches_per_step"] // world_size
    curve = []
    for i in range(len(expected["losses"])):
        step, losses = expected["save_at"] + i, []
        for micro in range(gas):
            loss = engine(*micro_batch(step, rank * gas + micro, 0), True)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        curve.append(losses)
    return curve
