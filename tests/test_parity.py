"""Stages 0/1/2/3 train exactly like one process on the global batch (fp32, <= 1e-5)."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import zeromem
from harness import run_distributed
from models import Reference, TinyLM, micro_batch, state_dict_diff, uses_sometimes

STEPS = 3


def config(stage: int, gas: int, clip: float, world_size: int, overlap: bool | None = None,
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


def build(use_init: bool) -> TinyLM:
    """TinyLM from seed 0, built whole or already partitioned under zeromem.Init."""
    torch.manual_seed(0)
    if not use_init:
        return TinyLM()
    with zeromem.Init():
        return TinyLM()


def train_and_compare(rank: int, world_size: int, stage: int, gas: int, clip: float,
                      extra: dict | None = None, tol: float = 1e-5,
                      use_init: bool = False, overlap: bool | None = None) -> list[float]:
    per_rank = stage < 3  # stage 3: every rank runs the same modules
    ref = Reference(build(False), clip=clip, per_rank=per_rank)
    initial = copy.deepcopy(ref.model)
    model = build(use_init)
    engine = zeromem.initialize(model, config(stage, gas, clip, world_size, overlap,
                                              **(extra or {})))
    diffs = []
    for step in range(STEPS):
        for micro in range(gas):
            tokens, targets = micro_batch(step, rank, micro)
            loss = engine(tokens, targets, uses_sometimes(step, rank, micro, per_rank))
            engine.backward(loss)
            engine.step()
        ref.step(step, world_size, gas)
        diffs.append(state_dict_diff(engine.full_state_dict(), ref.model))
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS * gas
    assert state_dict_diff(engine.full_state_dict(), initial) > 1e-3 or rank, "did not train"
    assert max(diffs) <= tol, f"stage {stage} gas {gas} clip {clip}: diffs {diffs}"
    return diffs


def parity_matrix(rank: int, world_size: int) -> dict:
    out = {}
    for stage, gas, clip in itertools.product((0, 1, 2, 3), (1, 3), (0.0, 0.05)):
        # with clipping, buckets are reduced asynchronously while backward goes on
        out[(stage, gas, clip)] = train_and_compare(rank, world_size, stage, gas, clip,
                                                    overlap=True if clip else None)
    for gas, clip in itertools.product((1, 3), (0.0, 0.05)):  # stage 3 built under Init
        out[("init", gas, clip)] = train_and_compare(rank, world_size, 3, gas, clip, use_init=True)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp32_parity_all_stages(world_size):
    results = run_distributed(parity_matrix, world_size)
    assert len(results[0]) == 20
    for diffs in results[0].values():
        assert all(d <= 1e-5 for d in diffs)


def clipping_is_active(rank: int, world_size: int) -> tuple[float, float]:
    torch.manual_seed(0)
    engine = zeromem.initialize(TinyLM(), config(2, 1, 0.05, world_size))
    tokens, targets = micro_batch(0, rank, 0)
    engine.backward(engine(tokens, targets))
    engine.step()
    # reference norm from torch on the same global batch
    torch.manual_seed(0)
    ref = TinyLM()
    for r in range(world_size):
        t, y = micro_batch(0, r, 0)
        (ref(t, y) / world_size).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1e9)
    return engine.get_global_grad_norm(), float(ref_norm)


def test_pre_clip_norm_matches_torch():
    for norm, ref_norm in run_distributed(clipping_is_active, 2):
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert norm > 0.05  # so the parity cases with clip=0.05 really clip
