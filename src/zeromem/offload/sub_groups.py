"""How the NVMe optimizer cuts a rank's shard into sub-groups and lays out its pool and file.

Pure arithmetic, no process group and no I/O: `SwappedOptimizer` (nvme_optimizer.py)
and the planner (`planning/host_memory.py`) both call `layout_optimizer`, so the bytes
the planner predicts are the bytes the engine allocates. A sub-group is at most
`sub_group_size` shard elements of one param group, swapped and stepped together; its
record in optimizer.swp is `[master] [state 1] [state 2] ...`, each field ALIGN-aligned.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Sequence

from zeromem.offload.budget import FP32 as FP32_BYTES
from zeromem.offload.budget import MIN_SUB_GROUP, PoolSize, size_optimizer_pool
from zeromem.offload.nvme import ALIGN, BufferPool, piece_bytes, round_up


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + numel) of `group`'s shard, at `at` in its sub-group."""

    group: Any  # a FlatParamGroup (or the planner's ShardSpec)
    start: int
    numel: int
    at: int


@dataclass
class SubGroup:
    """At most `sub_group_size` shard elements of one param group, swapped and stepped together."""

    param_group: int
    pieces: list[Piece] = field(default_factory=list)
    numel: int = 0
    offset: int = 0  # bytes: start of this sub-group's record in the swap file

    @property
    def field_bytes(self) -> int:
        return round_up(self.numel * 4)


def plan_sub_groups(groups: Sequence[Any], sub_group_size: int) -> list[SubGroup]:
    """Cut the shards of `groups` into sub-groups, in group order, never across param groups."""
    subs: list[SubGroup] = []
    for pg in dict.fromkeys(g.param_group_index for g in groups):
        current = None
        for g in (g for g in groups if g.param_group_index == pg):
            start = 0
            while start < g.shard_numel:
                if current is None or current.numel == sub_group_size:
                    current = SubGroup(pg)
                    subs.append(current)
                n = min(g.shard_numel - start, sub_group_size - current.numel)
                current.pieces.append(Piece(g, start, n, current.numel))
                current.numel += n
                start += n
    return subs


@dataclass(frozen=True)
class ShardSpec:
    """A flat group's shard as the layout below needs it (the planner has no FlatParamGroup)."""

    param_group_index: int
    shard_numel: int


@dataclass(frozen=True)
class OptimizerLayout:
    """How `SwappedOptimizer` cuts a rank's shard and sizes its pool and swap file.

    One function (`layout_optimizer`) computes it for the optimizer and for the
    planner (`planning/host_memory.py`), so the two cannot drift.
    """

    size: PoolSize
    sub_groups: list[SubGroup]  # offsets set: each record is file_fields x field_bytes
    states: int  # optimizer states per element (fp32 fields)
    master_in_file: bool  # the master is not the parameter shard, so it is swapped too
    grads_in_file: bool  # gradients come from grads.swp into a slot of their own (stage 2/3)
    slot_bytes: int  # one pool buffer: the largest field, or the largest gradient read

    @property
    def slot_fields(self) -> int:
        """Pool buffers per sub-group in flight: master + states (+ grad)."""
        return 1 + self.states + self.grads_in_file

    @property
    def file_fields(self) -> int:
        """Fields per record in optimizer.swp: (master +) states."""
        return self.master_in_file + self.states

    @property
    def pool_nbytes(self) -> int:
        """Host bytes of the optimizer pool (`BufferPool.nbytes` of the arena it allocates)."""
        return BufferPool.bytes_for(self.size.depth * self.slot_fields, self.slot_bytes)

    @cached_property
    def master_nbytes(self) -> int:
        """Bytes of optimizer.swp holding masters (0 when the master is the parameter shard)."""
        return sum(sg.field_bytes for sg in self.sub_groups) if self.master_in_file else 0

    @cached_property  # read at every record's offset (`SwappedOptimizer._record`)
    def file_bytes(self) -> int:
        """The size optimizer.swp is created with."""
        return sum(sg.field_bytes for sg in self.sub_groups) * self.file_fields


def grad_slot_bytes(sg: SubGroup) -> int:
    """Bytes of a sub-group's grad buffer: each piece's read starts at an aligned file offset."""
    return sum(piece_bytes(p.numel) for p in sg.pieces)


def layout_optimizer(groups: Sequence[Any], states: int, master_in_file: bool,
                     grads_in_file: bool, budget_bytes: int, params_pool_bytes: int,
                     sub_group_size: int | None, buffer_count: int | None) -> OptimizerLayout:
    """The pool and file of an NVMe optimizer with `states` fp32 states per element.

    `groups`: flat groups (or `ShardSpec`s) in order; `grads_in_file`: gradients are read
    from grads.swp into a slot of their own (stage 2/3); the rest as `size_optimizer_pool`.
    """
    slot_fields = 1 + states + (1 if grads_in_file else 0)
    size = size_optimizer_pool(budget_bytes, slot_fields, _largest_param_group(groups),
                               params_pool_bytes, sub_group_size, buffer_count)
    # gradients, and fp32 masters read from the parameter shards, are read piece by piece
    pieces_read = grads_in_file or not master_in_file

    def cut(size: PoolSize) -> tuple[list[SubGroup], PoolSize]:
        sub_groups = plan_sub_groups(groups, size.sub_group_size)
        slot_bytes = max((max(sg.field_bytes, grad_slot_bytes(sg) if pieces_read else 0)
                          for sg in sub_groups), default=ALIGN)
        return sub_groups, replace(size, slot_bytes=slot_bytes)

    while True:  # a derived size shrinks until the cut sub-groups' buffers fit the budget
        sub_groups, size = cut(size)
        over = size.pool_bytes - size.room_bytes()
        if not size.derived or over <= 0 or size.sub_group_size <= MIN_SUB_GROUP:
            break
        fewer = -(-over // (size.buffer_count * FP32_BYTES)) // 1024 * 1024 + 1024
        size = replace(size, sub_group_size=max(MIN_SUB_GROUP, size.sub_group_size - fewer))
    if size.derived:  # as many sub-groups, of equal size: every buffer is used whole
        largest = _largest_param_group(groups)
        equal = max(MIN_SUB_GROUP, -(-largest // -(-largest // size.sub_group_size)))
        if equal < size.sub_group_size:
            # kept only within the budget: a sub-group of more pieces needs ALIGN more each
            cut_equal = cut(replace(size, sub_group_size=equal))
            if not cut_equal[1].over_budget or size.over_budget:
                sub_groups, size = cut_equal
    # never more sub-groups in flight than the shard has: buffers no step can use are not held
    size = replace(size, depth=max(1, min(size.depth, len(sub_groups))))
    file_fields = int(master_in_file) + states
    total = 0
    for sg in sub_groups:
        sg.offset, total = total, total + sg.field_bytes * file_fields
    return OptimizerLayout(size, sub_groups, states, master_in_file, grads_in_file, size.slot_bytes)


def _largest_param_group(groups: Sequence[Any]) -> int:
    """Shard elements of the largest param group on this rank (sub-groups never span two)."""
    totals: dict[int, int] = {}
    for g in groups:
        totals[g.param_group_index] = totals.get(g.param_group_index, 0) + g.shard_numel
    return max(totals.values(), default=1)
