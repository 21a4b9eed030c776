"""Bucket sizes and prefetch depth derived from the model (layout.py); explicit values win."""
from __future__ import annotations

import pytest
import torch

import zeromem
from models import Deep
from zeromem.layout import derived_bucket_numel, derived_prefetch_numel


def test_the_rule():
    assert derived_bucket_numel(25_000, 2) == 2 ** 20          # small model: one bucket
    assert derived_bucket_numel(40_000_000, 2) == 10_000_000   # a quarter of the model
    assert derived_bucket_numel(40_000_000_000, 64) == 500_000_000  # DeepSpeed's cap
    assert derived_bucket_numel(1_000_000, 16) == 8 * 2 ** 20  # latency grows with N_d
    assert derived_prefetch_numel(300) == 600                 # two units ahead


def engine(stage: int, **zero):
    torch.manual_seed(0)
    return zeromem.initialize(Deep(width=64, depth=4), {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, **zero}})


@pytest.mark.parametrize("stage", [2, 3])
def test_defaults_come_from_the_model_and_explicit_values_win(stage):
    derived = derived_bucket_numel(4 * (64 * 64 + 64), 1)
    default = engine(stage)
    assert default.bucket_sizes["reduce_bucket_size"] == derived
    assert default.bucket_sizes["allgather_bucket_size"] == derived
    explicit = engine(stage, reduce_bucket_size=1000, allgather_bucket_size=3000,
                      stage3_prefetch_bucket_size=7)
    assert explicit.bucket_sizes["reduce_bucket_size"] == 1000
    assert explicit.bucket_sizes["allgather_bucket_size"] == 3000
    if stage == 3:
        largest = max(g.numel for g in default.groups)
        assert default.bucket_sizes["stage3_prefetch_bucket_size"] == 2 * largest
        assert default.stage3.limits.prefetch_numel == 2 * largest
        assert explicit.stage3.limits.prefetch_numel == 7
    else:  # stage 2: one flat group per reduce bucket; 1000 elements holds no 4160 layer whole
        assert len(explicit.groups) == 8 and len(default.groups) == 1
