"""The flat group's state machine (flat.py): one owner, named transitions. No process group."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from setups import OneRank
from zeromem.flat import (ContiguousShards, FlatParamGroup, GroupState, ShardAccumulated,
                          WholeAllReduced, WholeScattered)
from zeromem.layout import Sharding
from zeromem.offload.masters import HostGrads

SHAPES = [(3, 5), (7,), (2, 2, 2)]


def _group(stage: int, world: int = 2, rank: int = 1) -> FlatParamGroup:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    return FlatParamGroup(params, [f"m.p{i}" for i in range(len(SHAPES))],
                          SimpleNamespace(rank=rank, world_size=world), Sharding.for_stage(stage), 0)


def test_stage3_group_walks_sharded_gathering_gathered_and_memory_matches():
    g = _group(3)
    assert g.state is GroupState.SHARDED and g.full is None and g.flat_param is None
    assert all(p.numel() == 0 for p in g.params)
    with pytest.raises(AssertionError, match="GATHERING"):
        g.finish_gather()  # nothing is being gathered
    with pytest.raises(AssertionError):
        g.adopt_whole()
    full = g.begin_gather()  # the group's own whole buffer, for the all-gather to fill
    assert full.numel() == g.padded_numel and g.full is full
    full.copy_(torch.arange(g.padded_numel, dtype=torch.float32))
    assert g.state is GroupState.GATHERING and all(p.numel() == 0 for p in g.params)
    with pytest.raises(AssertionError):
        g.drop_shard_storage()  # the all-gather in flight reads the shard
    with pytest.raises(AssertionError):
        g.begin_gather()
    g.finish_gather()
    assert g.state is GroupState.GATHERED
    assert [tuple(p.shape) for p in g.params] == SHAPES
    assert g.params[1].data_ptr() == full[15:].data_ptr()  # views of the whole buffer
    g.adopt_whole()
    assert torch.equal(g.param_shard, full[g.shard_offset:g.shard_offset + g.shard_numel])
    kept = g.params[1].data.view(-1)  # as autograd keeps a view it saved in forward
    g.reshard()
    assert g.state is GroupState.SHARDED and g.full is None
    assert all(p.numel() == 0 for p in g.params)
    assert kept.untyped_storage().nbytes() == 0  # the saved view holds no memory now
    with pytest.raises(AssertionError):
        g.reshard()
    again = g.begin_gather()  # the next gather refills the storage that view shares
    again.copy_(torch.arange(g.padded_numel, dtype=torch.float32))
    g.finish_gather()
    assert torch.equal(kept, torch.arange(15, 15 + kept.numel(), dtype=torch.float32))


def test_whole_groups_refuse_stage3_transitions():
    for stage in (0, 1, 2):
        g = _group(stage)
        assert g.state is GroupState.WHOLE and g.flat_param is not None
        assert [tuple(p.shape) for p in g.params] == SHAPES
        with pytest.raises(AssertionError, match="WHOLE"):
            g.begin_gather()
        with pytest.raises(AssertionError):
            g.reshard()


def test_owned_buffers_change_only_through_named_transitions():
    g = _group(2)
    for field in ("master", "param_shard", "flat_param", "state", "full"):
        with pytest.raises(AttributeError):
            setattr(g, field, None)
    assert not hasattr(g, "grads")  # the gradient part is reached through the group's verbs
    with pytest.raises(AssertionError):
        g.place_master(torch.zeros(g.shard_numel + 1))  # not this group's shard
    master = torch.zeros(g.shard_numel)
    g.place_master(master)
    assert g.master is master
    g.set_master_storage(torch.ones(g.shard_numel))
    assert g.master is master and master.sum() == g.shard_numel  # same tensor, new storage
    g.attach_grads(object())  # built once, knowing where its reduced gradient goes (offload)
    with pytest.raises(AssertionError, match="set once"):
        g.attach_grads(object())  # no wrapper attached afterwards: one writer of the field


def _reduced_once(kind, reduction: OneRank) -> None:
    """One backward's gradient of 1.0 everywhere into `kind`, reduced over one rank."""
    kind.accumulate(0, torch.ones(kind.group.numel))
    kind.launch(reduction).wait()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_buffer_built_with_host_copies_copies_its_reduced_shard_at_the_boundary_only(stage):
    """Offload's destination is given when the buffer is built (offload/placement.py
    `build_grads`): the reduced shard reaches the host buffer after a boundary reduction."""
    group = _group(stage, world=1, rank=0)
    host = HostGrads(pin=False)
    if stage == 1:
        kind = WholeScattered(group, torch.bfloat16, host)
    else:
        shards = ContiguousShards([group.shard_numel], torch.bfloat16, torch.device("cpu"))
        kind = ShardAccumulated(group, shards, 0, host)
    buffer = host.buffers[id(group)]
    assert buffer.dtype == torch.float32 and buffer.numel() == group.shard_numel
    reduction = OneRank()
    host.boundary = False  # accumulating: the reduced shard stays where it is reduced
    _reduced_once(kind, reduction)
    assert buffer.abs().sum() == 0
    host.boundary = True
    _reduced_once(kind, reduction)
    assert torch.equal(buffer, kind.reduced().float())
    assert buffer[:group.numel].min() > 0


def test_a_reduced_shard_already_in_fp32_host_memory_is_read_as_it_is():
    group = _group(2, world=1, rank=0)
    host = HostGrads(pin=False)
    shards = ContiguousShards([group.shard_numel], torch.float32, torch.device("cpu"))
    kind = ShardAccumulated(group, shards, 0, host)
    assert kind.host_buffer is None and host.buffers[id(group)] is kind.reduced()


def _kind(stage: int, group: FlatParamGroup):
    if stage < 2:
        return (WholeScattered if stage else WholeAllReduced)(group, torch.float32)
    shards = ContiguousShards([group.shard_numel], torch.float32, torch.device("cpu"))
    return ShardAccumulated(group, shards, 0)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_gradient_is_held_and_reduced_through_the_group(stage):
    """Filled at once (a stage-3 unit) or one parameter at a time (the optimizer's hooks),
    the group's reduced gradient is the sum; its square and zero act on that."""
    group = _group(stage, world=1, rank=0)
    group.attach_grads(_kind(stage, group))
    grads = [torch.full(s, float(i + 1)) for i, s in enumerate(SHAPES)]
    group.fill_grads([grads[0], None, grads[2]])
    group.add_grad(group.slots[1].offset, grads[1])
    group.launch_reduction(OneRank()).wait()
    want = torch.cat([g.reshape(-1) for g in grads])
    assert torch.equal(group.reduced_grad()[:group.numel], want)
    assert torch.isclose(group.grad_square(), (want ** 2).sum())
    assert group.reduces_every_microstep == (stage == 2)
    group.zero_grad()
    assert group.reduced_grad().abs().sum() == 0


def test_stage0_refuses_a_reduction_that_cannot_all_reduce():
    group = _group(0, world=1, rank=0)
    group.attach_grads(_kind(0, group))

    class ScatterOnly:  # as qgZ's quantized reduction
        def reduce_scatter(self, output, input, async_op=False): ...
        def note_buffer(self, tensor): ...
        def release_buffer(self, tensor): ...

    with pytest.raises(TypeError, match="all-reduces"):
        group.launch_reduction(ScatterOnly())
