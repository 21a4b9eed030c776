"""What the ZeRO optimizer's step calls, chosen once at construction (zero_optimizer.py):
with masters and parameter shards on the device, phases 3 and 5 are the flat groups' own
transitions and no placement is called; with either offloaded, the placement's verbs are.

No process group: one flat group over one rank (its shard is the whole buffer), a reduced
gradient written into it by hand, and placements that record (or refuse) each call.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zeromem.comm import Comm
from zeromem.flat import ContiguousShards, FlatParamGroup, ShardAccumulated
from zeromem.layout import Sharding
from zeromem.precision import NoScaler
from zeromem.zero_optimizer import StepSettings, ZeroOptimizer

LR = 0.5


def _group() -> FlatParamGroup:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(3))]
    comm = SimpleNamespace(rank=0, world_size=1)
    group = FlatParamGroup(params, ["w", "b"], comm, Sharding.for_stage(2), 0)  # type: ignore[arg-type]
    shards = ContiguousShards([group.shard_numel], torch.float32, torch.device("cpu"))
    group.attach_grads(ShardAccumulated(group, shards, 0))
    group.reduced_grad().copy_(torch.arange(group.shard_numel, dtype=torch.float32))
    return group


class Placement:
    """A masters placement `where` says, recording the step verbs it is asked for."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.calls: list[str] = []

    def start_backward(self, boundary: bool) -> None:
        self.calls.append("start_backward")

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        self.calls.append("unscale_grads")
        for g in groups:
            g.unscale_into_master(multiplier)

    def write_back(self, groups: list[FlatParamGroup], params: object) -> None:
        self.calls.append("write_back")
        for g in groups:
            g.write_back()

    def refresh(self, groups: list[FlatParamGroup], params: object) -> None:
        """After a checkpoint load: not a step verb."""

    def allow_step_in_backward(self, allowed: bool, keep_gradients: bool) -> None:
        """Told whether the next boundary backward may begin the step: not a step verb."""

    def skip_step(self) -> None:
        self.calls.append("skip_step")


def _optimizer(group: FlatParamGroup, masters: Placement, params: str) -> ZeroOptimizer:
    sgd = torch.optim.SGD([group.master], lr=LR)
    return ZeroOptimizer([group], SimpleNamespace(shard=Comm()), masters,  # type: ignore[arg-type]
                         SimpleNamespace(where=params), sgd, NoScaler(), None,  # type: ignore[arg-type]
                         StepSettings())


@pytest.mark.parametrize("masters, params, called", [
    ("device", "device", []),
    ("device", "host", ["start_backward", "unscale_grads", "write_back"]),
    ("host", "device", ["start_backward", "unscale_grads", "write_back"]),
])
def test_the_step_calls_a_placement_only_where_something_is_offloaded(masters, params, called):
    group = _group()
    before = group.param_shard.clone()
    grad = group.reduced_grad().clone()
    placement = Placement(masters)
    zero = _optimizer(group, placement, params)
    zero.start_backward(boundary=True)
    assert not zero.step()
    assert placement.calls == called
    # the same update either way: SGD on the master, written into the parameter shard
    torch.testing.assert_close(group.param_shard, before - LR * grad)
    norm = float(torch.linalg.vector_norm(grad))
    assert zero.grad_norm == pytest.approx(norm)
