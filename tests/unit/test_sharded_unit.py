"""A stage-3 unit's gradient life (stage3/sharded_unit.py): readiness counted once, in the unit,
which fills its group's bucket and hands its own reduce-scatter to the shard group's `Comm`,
which launches the units' buckets in order.

No process group: the unit's group is gathered by hand (world size 1), and the Comm (over one
rank) reduces with `OneRank`, a reduction over one rank (a reduce-scatter over one rank is a
copy), which records every bucket it is given.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from setups import OneRank
from zeromem.comm import Comm
from zeromem.flat import ContiguousShards, FlatParamGroup, GroupState, ShardAccumulated
from zeromem.layout import Sharding
from zeromem.stage3.sharded_unit import LiveStats, Phase, ShardedUnit

SHAPES = [(3, 5), (3,), (4,)]  # weight, bias, and a parameter used only sometimes


def _unit(max_buckets: int = 3) -> tuple[ShardedUnit, OneRank, list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    values = [p.detach().clone() for p in params]
    comm = SimpleNamespace(rank=0, world_size=1)
    group = FlatParamGroup(params, ["w", "b", "u"], comm, Sharding.for_stage(3), 0)  # type: ignore[arg-type]
    group.attach_grads(ShardAccumulated(group, ContiguousShards([group.shard_numel],
                                                                torch.float32, torch.device("cpu")), 0))
    reduction = OneRank()
    order = Comm()  # one rank: schedules the unit's bucket, reduced by `reduction`
    order.schedule_reductions(reduction, 1, max_buckets)
    order.start_reductions(reducing=True)
    unit = ShardedUnit(group, 0, order, False, LiveStats())
    for param in params:  # as its owner (the fetch schedule) hooks it
        param.register_post_accumulate_grad_hook(lambda p: _count(unit, p))
    full = group.begin_gather()  # world size 1: the shard is the whole buffer
    full.copy_(group.param_shard)
    group.finish_gather()
    return unit, reduction, values


def _count(unit: ShardedUnit, param: torch.Tensor) -> None:
    unit.grad_in(param)


def _loss(params, x: torch.Tensor, use_u: bool) -> torch.Tensor:
    w, b, u = params
    return (w @ x + b).pow(2).sum() + (u.sum() * 3 if use_u else 0)


def _expected(values: list[torch.Tensor], x: torch.Tensor, use_u: bool) -> torch.Tensor:
    ref = [v.clone().requires_grad_() for v in values]
    _loss(ref, x, use_u).backward()
    return torch.cat([torch.zeros(v.numel()) if r.grad is None else r.grad.reshape(-1)
                      for r, v in zip(ref, values)])


def _launches_seen(unit: ShardedUnit, reduction: OneRank) -> list[tuple[bool, int]]:
    """After each parameter's gradient reached the unit: (left param.grad?, launches so far)."""
    seen: list[tuple[bool, int]] = []
    for param in unit.group.params:  # a later hook on each parameter runs after the unit's
        param.register_post_accumulate_grad_hook(
            lambda p: seen.append((p.grad is None, len(reduction.buckets))))
    return seen


def test_the_last_gradient_fills_the_bucket_once_and_the_unit_launches_it():
    unit, reduction, values = _unit()
    assert unit.state is GroupState.GATHERED and unit.phase is Phase.FORWARD
    x = torch.randn(5)
    unit.start_pass(Phase.BACKWARD)
    seen = _launches_seen(unit, reduction)
    _loss(unit.group.params, x, True).backward()
    # gradients wait in param.grad until the last; then one bucket, launched at once
    assert seen == [(False, 0), (False, 0), (True, 1)]
    assert unit.phase is Phase.REDUCED and unit.comm.launched(0)
    assert all(p.grad is None for p in unit.group.params)  # the bucket held them
    (bucket,) = reduction.buckets
    assert bucket.numel() == unit.group.padded_numel
    assert torch.allclose(bucket[:unit.group.numel], _expected(values, x, True))
    unit.comm.finish_reductions()
    assert torch.allclose(unit.group.reduced_grad()[:unit.group.numel], _expected(values, x, True))


def test_a_unit_some_gradients_never_reach_hands_in_at_the_end():
    unit, reduction, values = _unit()
    x = torch.randn(5)
    unit.start_pass(Phase.BACKWARD)
    _loss(unit.group.params, x, False).backward()  # `u` unused on this rank
    assert reduction.buckets == [] and unit.phase is Phase.BACKWARD
    unit.finish_backward()
    assert unit.phase is Phase.REDUCED and len(reduction.buckets) == 1
    assert torch.allclose(reduction.buckets[0][:unit.group.numel],
                          _expected(values, x, False))  # zeros for u
    unit.comm.finish_reductions()


def test_a_unit_that_never_hands_in_is_an_error_at_the_end_of_backward():
    unit, _, _ = _unit()
    unit.start_pass(Phase.BACKWARD)
    _loss(unit.group.params, torch.randn(5), False).backward()
    with pytest.raises(RuntimeError, match="bucket 0 of 1 was never handed in"):
        unit.comm.finish_reductions()  # finish_backward was not called: its gradients would be lost


def test_gradients_outside_a_backward_stay_in_param_grad_and_none_after_the_reduction():
    """A backward the engine did not start (another engine's, through this module) leaves
    its gradients where PyTorch puts them: the unit neither counts nor launches them."""
    unit, reduction, _ = _unit()
    x = torch.randn(5)
    unit.start_pass(Phase.FORWARD)
    seen = _launches_seen(unit, reduction)
    _loss(unit.group.params, x, True).backward()  # not started by the engine's backward
    assert seen == [(False, 0)] * len(unit.group.params) and unit.phase is Phase.FORWARD
    unit.start_pass(Phase.BACKWARD)
    for p in unit.group.params:
        p.grad = None
    _loss(unit.group.params, x, True).backward()  # the unit launched its bucket
    with pytest.raises(RuntimeError, match="second gradient"):
        _loss(unit.group.params, x, True).backward()


def test_with_one_bucket_at_a_time_each_gradient_goes_in_as_it_comes():
    """Reduced shards to an NVMe file keep one bucket alive: no unit's gradients may wait
    in param.grad beside the reduction in flight; the bucket still launches at the last."""
    unit, reduction, values = _unit(max_buckets=1)
    x = torch.randn(5)
    unit.start_pass(Phase.BACKWARD)
    seen = _launches_seen(unit, reduction)
    _loss(unit.group.params, x, True).backward()
    assert seen == [(True, 0), (True, 0), (True, 1)]
    assert unit.phase is Phase.REDUCED
    assert torch.allclose(reduction.buckets[0][:unit.group.numel], _expected(values, x, True))
    unit.comm.finish_reductions()
