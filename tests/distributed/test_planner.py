"""The planner's model-state bytes against real runs (the pure planner tests are in
tests/unit/test_planner_formulas.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeromem
from harness import run_distributed
from zeromem.planning.planner import predict_memory, shape_of


# ---------------------------------------------------------------- predicted vs measured

class Known(nn.Module):
    """Known, odd shapes: padding, several reduce buckets, a tied head and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(301, 96)
        self.up = nn.Linear(96, 250)
        self.down = nn.Linear(250, 96)
        self.frozen = nn.Linear(96, 96)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(96, 301, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        frozen = self.frozen(h.to(self.frozen.weight.dtype)).to(h.dtype)  # (bf16 in one test)
        h = h + self.down(torch.relu(self.up(h))) + frozen
        return self.head(h).float().logsumexp(-1).mean()


STAGES = (0, 1, 2, 3)


def _config(stage: int, persistence: int = 25_000) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 30_000,
                                  # stage 3: the embedding is partitioned, up and down persist
                                  "stage3_param_persistence_threshold": persistence}}


def _bf16_masters_config(stage: int) -> dict:
    config = _config(stage, persistence=0)
    config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return config


def _measure(rank, world_size, stages=STAGES, persistence=25_000, bf16_masters=False):
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        config = _bf16_masters_config(stage) if bf16_masters else _config(stage, persistence)
        engine = zeromem.initialize(Known(), config)
        for _ in range(2):
            engine.backward(engine(torch.randint(0, 301, (2, 5))))
            engine.step()
        out[stage] = engine.memory_report().to_dict()
    return out


def test_plan_predicts_stage3_memory_with_every_unit_sharded_the_frozen_one_too():
    """Nothing persists: the frozen layer is sharded in a unit of its own (it was whole)."""
    measured = run_distributed(_measure, 2, (3,), 0)
    with torch.device("meta"):
        shape = shape_of(Known(), bucket_numel=30_000)
    predicted = predict_memory(shape, _config(3, 0), 2)
    for rank, report in enumerate(measured):
        held = report[3]["model_state_bytes"]
        assert predicted.model_state_bytes == pytest.approx(held, rel=0.02), rank
        assert predicted.device["params"] == pytest.approx(
            report[3]["held"]["params"]["device"], rel=0.02), rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_plan_predicts_measured_memory(world_size):
    measured = run_distributed(_measure, world_size)
    with torch.device("meta"):
        shape = shape_of(Known(), bucket_numel=30_000)  # merged fetch units: at most a bucket
    for stage in STAGES:
        predicted = predict_memory(shape, _config(stage), world_size)
        for rank, report in enumerate(measured):
            held = report[stage]["model_state_bytes"]
            assert predicted.model_state_bytes == pytest.approx(held, rel=0.05), (stage, rank)
            for category, value in predicted.device.items():
                assert value == pytest.approx(report[stage]["held"][category]["device"], rel=0.05)




def _measure_fp32_with_bf16_frozen(rank, world_size):
    """fp32 (no precision block) with the frozen layer in bf16, which the run keeps."""
    out = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = Known()
        model.frozen.to(torch.bfloat16)
        engine = zeromem.initialize(model, _fp32_config(stage))
        engine.backward(engine(torch.randint(0, 301, (2, 5))))
        engine.step()
        out[stage] = engine.memory_report().to_dict()
    return out


def _fp32_config(stage: int) -> dict:
    config = _config(stage, persistence=0)
    del config["bf16"]
    return config


def test_plan_counts_frozen_parameters_in_their_own_dtype_when_training_in_fp32():
    measured = run_distributed(_measure_fp32_with_bf16_frozen, 2)
    with torch.device("meta"):
        model = Known()
        model.frozen.to(torch.bfloat16)
        shape = shape_of(model, bucket_numel=30_000)
    for stage in (0, 3):
        predicted = predict_memory(shape, _fp32_config(stage), 2)
        for rank, report in enumerate(measured):
            assert predicted.device["params"] == pytest.approx(
                report[stage]["held"]["params"]["device"], rel=0.02), (stage, rank)
            assert predicted.model_state_bytes == pytest.approx(
                report[stage]["model_state_bytes"], rel=0.02), (stage, rank)


def test_plan_counts_bf16_masters_and_states_as_the_run_holds_them():
    """No master copy, Adam's states in bf16: each category as the run's ledger files it."""
    measured = run_distributed(_measure, 2, (1, 2, 3), 0, True)
    with torch.device("meta"):
        shape = shape_of(Known(), bucket_numel=30_000)
    for stage in (1, 2, 3):
        predicted = predict_memory(shape, _bf16_masters_config(stage), 2)
        assert predicted.device["master_params"] == 0, stage
        for rank, report in enumerate(measured):
            for category, value in predicted.device.items():
                held = report[stage]["held"].get(category, {}).get("device", 0)
                assert value == pytest.approx(held, rel=0.02), (stage, rank, category)
