"""Sizing NVMe offload's host buffers from one host budget (ZeRO-Infinity, arXiv 2104.07857, 5).

With optimizer states on NVMe, the host memory offload itself holds is two pools:
the parameter pool (`offload_param.buffer_count` buffers, each the largest
parameter shard; its size is set by the model's largest fetch unit) and the
optimizer pool (`buffer_count` buffers of one sub-group field each). Neither
grows with the model's depth, so a fixed budget bounds them.

`size_optimizer_pool` spends what the parameter pool leaves of the budget
`zeromem.offload_host_budget_bytes` on the optimizer pool:

    depth        = 3 sub-groups in flight (read i+1 / update i / write i-1),
                   6 of half the size when each still keeps MIN_DEEP_SUB_GROUP,
                   or buffer_count // fields when the config sets buffer_count
    buffer_count = depth x fields   (fields = master + optimizer states)
    sub_group    = (budget - parameter pool) / (buffer_count x 4 bytes),
                   at least MIN_SUB_GROUP, at most the largest param group's shard,
                   unless the config sets sub_group_size

The parameter pool's buffers are as large as the largest fetch unit's shard, so
by default fetch units are merged only while that shard stays within the pool's
share of the budget (`pool_unit_numel`, 1/PARAMS_SHARE of it; stage3/units.py):
merging by the model's size would make the pool, and so the host memory, grow
with the model.

DeepSpeed's default sub_group_size (1e9 elements) makes one sub-group of a
whole shard, i.e. a pool as large as the states it was meant to keep on disk;
that default is therefore not used unless the config names it. Pure arithmetic,
tested without a process group.
"""
from __future__ import annotations

from dataclasses import dataclass

from zeromem.offload.nvme import ALIGN

DEPTH = 3  # sub-groups in flight: one read ahead, one updating, one written behind
# elements (256 KiB per fp32 field): with a deep queue, requests of this size keep an NVMe
# drive busy; below it a small budget is exceeded (`PoolSize.over_budget` says so)
MIN_SUB_GROUP = 1 << 16
FP32 = 4
# with the step inside backward (offload/backward_step.py) one unit's gradient completes
# several sub-groups at once: 3 slots then make the step wait on reads (measured at
# W=2048, 16 layers, 2 ranks), so a budget with room cuts the same pool into 6 sub-groups
# half as large, as long as each keeps requests of 512 KiB per field
DEEP_DEPTH = 6
MIN_DEEP_SUB_GROUP = 1 << 17
# the parameter pool's share of the budget (1/PARAMS_SHARE) when it decides how far fetch
# units merge: the optimizer pool keeps the rest, room for sub-groups well above MIN_SUB_GROUP.
# Half, not a quarter: each unit costs the step a gather, a release and a bucket, and at
# W=1024 (16 layers, 2 ranks) a quarter kept every layer a unit of its own (16 against CPU
# offload's 8), about 0.06 CPU-s of a 0.6 s step
PARAMS_SHARE = 2


@dataclass(frozen=True)
class PoolSize:
    """How the optimizer pool is cut: `depth` sub-groups of `sub_group_size` elements in flight."""

    sub_group_size: int
    depth: int
    fields: int
    budget_bytes: int
    params_pool_bytes: int
    derived: bool  # sub_group_size came from the budget, not from the config
    # one pool buffer once the sub-groups are cut (sub_groups.layout_optimizer): a gradient
    # read of several pieces needs ALIGN more per piece; 0 = not cut yet, one field's bytes
    slot_bytes: int = 0

    @property
    def buffer_count(self) -> int:
        return self.depth * self.fields

    @property
    def pool_bytes(self) -> int:
        """Host bytes of the optimizer pool (before the arena's alignment slack)."""
        field = -(-self.sub_group_size * FP32 // ALIGN) * ALIGN
        return self.buffer_count * max(field, self.slot_bytes)

    def room_bytes(self) -> int:
        """What the budget leaves the optimizer pool (its arena's alignment slack aside)."""
        return self.budget_bytes - self.params_pool_bytes - ALIGN

    @property
    def over_budget(self) -> bool:
        """The pools exceed the budget (it is below the minimum sub-group, or the config's
        sub_group_size / buffer_count ask for more)."""
        return self.pool_bytes > self.room_bytes()

    def describe(self) -> str:
        mb = 1e6
        source = "from the budget" if self.derived else "from the config"
        over = (f"; EXCEEDS the budget (at least {MIN_SUB_GROUP:,} elements per sub-group, "
                "or the config's sizes)" if self.over_budget else "")
        return (f"NVMe offload host budget {self.budget_bytes / mb:.1f} MB "
                f"(zeromem.offload_host_budget_bytes): optimizer pool {self.buffer_count} buffers "
                f"x sub_group_size {self.sub_group_size:,} ({source}) = "
                f"{self.pool_bytes / mb:.1f} MB, parameter pool {self.params_pool_bytes / mb:.1f} MB"
                f"{over}")


def size_optimizer_pool(budget_bytes: int, fields: int, largest_shard_numel: int,
                        params_pool_bytes: int, sub_group_size: int | None,
                        buffer_count: int | None) -> PoolSize:
    """The optimizer pool for `fields` fp32 fields per sub-group within `budget_bytes`.

    `sub_group_size` / `buffer_count`: the config's values when it sets them, else None.
    `largest_shard_numel`: the largest param group's shard on this rank (a sub-group never
    spans param groups, so a larger one would only waste memory).
    """
    depth = DEPTH if buffer_count is None else max(1, buffer_count // fields)
    if sub_group_size is not None:
        return PoolSize(sub_group_size, depth, fields, budget_bytes, params_pool_bytes, False)
    left = budget_bytes - params_pool_bytes
    if buffer_count is None and _fitting_size(left, DEEP_DEPTH, fields) >= MIN_DEEP_SUB_GROUP:
        depth = DEEP_DEPTH
    size = max(MIN_SUB_GROUP, _fitting_size(left, depth, fields))
    size = max(1, min(size, largest_shard_numel))
    return PoolSize(size, depth, fields, budget_bytes, params_pool_bytes, True)


def _fitting_size(room_bytes: int, depth: int, fields: int) -> int:
    """The largest sub-group (a multiple of 1024 elements) whose `depth` x `fields` fp32
    buffers fit in `room_bytes`."""
    return room_bytes // (depth * fields * FP32) // 1024 * 1024


def pool_unit_numel(budget_bytes: int, buffer_count: int, param_bytes: int,
                    shard_world: int) -> int:
    """Largest merged fetch unit (elements over all `shard_world` ranks) whose shard keeps a
    pool of `buffer_count` buffers within 1/PARAMS_SHARE of `budget_bytes` (`param_bytes`
    per parameter element). A unit that is one block stays whole whatever its size."""
    shard_numel = budget_bytes // PARAMS_SHARE // buffer_count // param_bytes
    return max(1, shard_numel) * shard_world
