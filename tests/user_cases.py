"""Small setups that users run, and the helpers the tests of them share
(tests/distributed/test_user_setups.py, test_frozen_weights.py).

One spawned world of two ranks runs each test module's cases once (`run_cases`); each
test reads the results it needs, and compares every rank, not rank 0 only.
"""
from __future__ import annotations

import contextlib
import traceback
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import zeromem

WORLD = 2
STAGES = (0, 1, 2, 3)
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}


class Net(nn.Module):
    """Odd sizes (padding), a BatchNorm (buffers), no tied weights."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 9)
        self.norm = nn.BatchNorm1d(9)
        self.fc2 = nn.Linear(9, 3)

    def forward(self, x):                         # x: (B, 6)
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))  # (B, 3)


def build(seed: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():  # running statistics that differ with the seed as well
        net.norm.running_mean.uniform_(-1, 1)
        net.norm.running_var.uniform_(0.5, 2.0)
    return net


def config(stage: int, precision: str, lr: float = 1e-2) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, **PRECISIONS[precision],
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def train_step(engine, step: int, rank: int) -> None:
    x = batch(step, rank).to(engine.compute_dtype)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()


def whole_state(engine) -> dict[str, torch.Tensor]:
    """This rank's module state in fp32: parameters whole (gathered at stage 3), buffers."""
    gathered = zeromem.GatheredParameters(list(engine.module.parameters())) \
        if engine.zero_stage == 3 else contextlib.nullcontext()
    with gathered:
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


def tokens(step: int) -> torch.Tensor:
    """The global batch of a step: 8 token ids (each rank takes its 4)."""
    return torch.randint(0, 13, (8,), generator=torch.Generator().manual_seed(step))


def mlp() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))


def run_cases(rank: int, world_size: int, cases: dict[str, Callable[[int], object]]) -> dict:
    """Every case on this rank (spawned once per test module: spawning costs seconds)."""
    results = {}
    for name, case in cases.items():
        try:
            # numpy arrays: torch tensors would travel as shared memory the ended rank took away
            results[name] = tree_map(lambda v: v.numpy() if torch.is_tensor(v) else v, case(rank))
        except Exception:  # noqa: BLE001 (one broken case must not hide the others' results)
            results[name] = traceback.format_exc()
    return results


def case(ranks: list[dict], name: str) -> list:
    """What each rank returned for case `name`; the test fails with its traceback if any
    rank's case raised."""
    for r, result in enumerate(ranks):
        if isinstance(result[name], str):
            pytest.fail(f"case {name!r} failed on rank {r}:\n{result[name]}")
    return [tree_map(lambda v: torch.from_numpy(v) if isinstance(v, np.ndarray) else v,
                     result[name]) for result in ranks]


def max_diff(a: dict, b: dict, keys=None) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in (keys or a))


def rounded(state: dict, precision: str) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return {k: v.to(dtype).float() if v.is_floating_point() else v.float() for k, v in state.items()}
