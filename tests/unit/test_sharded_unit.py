"""A stage-3 unit's gradient life (stage3/sharded_unit.py): readiness counted once, in the unit.

No process group: the unit's group is gathered by hand (world size 1), and the reducer is a
recorder of what the unit asked for (it launches nothing: no collective is imitated).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zeromem.flat import FlatParamGroup, GroupState, Sharding
from zeromem.stage3.sharded_unit import LiveStats, Phase, ShardedUnit
from zeromem.zero_optimizer import ContiguousShards, ShardAccumulated

SHAPES = [(3, 5), (3,), (4,)]  # weight, bias, and a parameter used only sometimes


class Recorder:
    """The reducer's side of the protocol, recorded in order."""

    def __init__(self) -> None:
        self.events: list = []
        self.launched_now = False
        self.one_bucket = False

    def bucket_starts(self) -> None:
        self.events.append("bucket")

    def group_ready(self, index: int) -> None:
        self.events.append(("ready", index))

    def launched(self, index: int) -> bool:
        return self.launched_now

    def one_bucket_at_a_time(self) -> bool:
        return self.one_bucket


def _unit(one_bucket: bool = False) -> tuple[ShardedUnit, Recorder, list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    values = [p.detach().clone() for p in params]
    comm = SimpleNamespace(rank=0, world_size=1)
    group = FlatParamGroup(params, ["w", "b", "u"], comm, Sharding.for_stage(3), 0)  # type: ignore[arg-type]
    group.attach_grads(ShardAccumulated(group, ContiguousShards([group.shard_numel],
                                                                torch.float32, torch.device("cpu")), 0))
    recorder = Recorder()
    recorder.one_bucket = one_bucket
    unit = ShardedUnit(group, 0, recorder, comm, False, LiveStats())  # type: ignore[arg-type]
    full = group.begin_gather()  # world size 1: the shard is the whole buffer
    full.copy_(group.param_shard)
    group.finish_gather()
    return unit, recorder, values


def _loss(params, x: torch.Tensor, use_u: bool) -> torch.Tensor:
    w, b, u = params
    return (w @ x + b).pow(2).sum() + (u.sum() * 3 if use_u else 0)


def _expected(values: list[torch.Tensor], x: torch.Tensor, use_u: bool) -> torch.Tensor:
    ref = [v.clone().requires_grad_() for v in values]
    _loss(ref, x, use_u).backward()
    return torch.cat([torch.zeros(v.numel()) if r.grad is None else r.grad.reshape(-1)
                      for r, v in zip(ref, values)])


def test_the_last_gradient_moves_all_into_the_bucket_once():
    unit, recorder, values = _unit()
    assert unit.state is GroupState.GATHERED and unit.phase is Phase.FORWARD
    x = torch.randn(5)
    unit.start_pass(Phase.BACKWARD)
    _loss(unit.group.params, x, True).backward()
    # one bucket, filled and handed over once, after every gradient was in
    assert recorder.events == ["bucket", ("ready", 0)]
    assert unit.phase is Phase.REDUCED
    assert all(p.grad is None for p in unit.group.params)  # the bucket holds them
    bucket = unit.group.grads.bucket.take()
    assert bucket.numel() == unit.group.padded_numel
    assert torch.allclose(bucket[:unit.group.numel], _expected(values, x, True))


def test_a_unit_some_gradients_never_reach_hands_over_at_the_end():
    unit, recorder, values = _unit()
    x = torch.randn(5)
    unit.start_pass(Phase.BACKWARD)
    _loss(unit.group.params, x, False).backward()  # `u` unused on this rank
    assert recorder.events == [] and unit.phase is Phase.BACKWARD
    unit.finish_backward()
    assert recorder.events == ["bucket"] and unit.phase is Phase.REDUCED
    bucket = unit.group.grads.bucket.take()
    assert torch.allclose(bucket[:unit.group.numel], _expected(values, x, False))  # zeros for u


def test_gradients_arrive_only_in_a_backward_and_not_after_the_reduction():
    unit, recorder, _ = _unit()
    x = torch.randn(5)
    unit.start_pass(Phase.FORWARD)
    with pytest.raises(AssertionError, match="expected phase in \\['BACKWARD'\\], got FORWARD"):
        _loss(unit.group.params, x, True).backward()  # not started by the engine's backward
    unit.start_pass(Phase.BACKWARD)
    for p in unit.group.params:
        p.grad = None
    _loss(unit.group.params, x, True).backward()
    recorder.launched_now = True  # the reducer launched this unit's bucket
    with pytest.raises(RuntimeError, match="second gradient"):
        _loss(unit.group.params, x, True).backward()


def test_with_one_bucket_at_a_time_each_gradient_goes_in_as_it_comes():
    """Reduced shards to an NVMe file keep one bucket alive: no unit's gradients may wait
    in param.grad beside the reduction in flight."""
    unit, recorder, values = _unit(one_bucket=True)
    x = torch.randn(5)
    unit.start_pass(Phase.BACKWARD)
    seen = []  # a later hook on each parameter: its gradient has left param.grad by then
    for param in unit.group.params:
        param.register_post_accumulate_grad_hook(
            lambda p: seen.append((p.grad is None, recorder.events.count("bucket"))))
    _loss(unit.group.params, x, True).backward()
    assert seen == [(True, 1)] * 3
    assert recorder.events == ["bucket", ("ready", 0)] and unit.phase is Phase.REDUCED
    bucket = unit.group.grads.bucket.take()
    assert torch.allclose(bucket[:unit.group.numel], _expected(values, x, True))
