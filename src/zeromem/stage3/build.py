"""Stage 3 applied to a model: which parameters form each unit, then the units and their schedule.

The engine builds the flat groups of every stage itself (flat.py); at stage 3 it asks
this module twice, in this order (torchtitan's `apply_*(model, config)` style: the
config and the parts are passed in, nothing is read from the engine):

1. `choose_units`, before the flat groups exist: the fetch units (units.py), each
   one flat group per optimizer param group it spans, with the modules that gather it.
2. `build_stage3`, once the groups, their gradient buffers, the parameter placement
   (offload/params.py) and the ZeRO optimizer exist: one `ShardedUnit` per flat group
   (sharded_unit.py: gather, release, gradient reduction), the prefetch window, and
   the `FetchSchedule` that hooks the modules (fetch.py); `GatheredParameters` finds
   the units through `partitions`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from zeromem.comm import Comm
from zeromem.config.schema import Config
from zeromem.flat import FlatParamGroup
from zeromem.hierarchy import CommPlan
from zeromem.layout import derived_prefetch_numel
from zeromem.offload.params import ParamPlacement
from zeromem.offload.placement import OffloadPolicy
from zeromem.stage3.fetch import FetchSchedule, Stage3Limits
from zeromem.stage3.sharded_unit import LiveStats, ShardedUnit
from zeromem.stage3.partitioned_init import Partitions
from zeromem.stage3.units import (UnitCaps, default_target, describe, plan_fetch_units,
                                  unmerged_units)
from zeromem.zero_optimizer import ZeroOptimizer

log = logging.getLogger("zeromem")


@dataclass(frozen=True)
class UnitChoice:
    """The fetch units chosen for a model, as flat groups to build."""

    parts: list[tuple[int, list[nn.Parameter]]]  # (param group index, parameters) per group
    modules: list[list[nn.Module]]  # per part: the modules whose hooks gather it
    report: str  # one line per unit, for the run report (units.describe)


def unit_caps(config: Config, compute_dtype: torch.dtype, shard_world: int,
              bucket_numel: int) -> UnitCaps:
    """What bounds a merged fetch unit: the reduce bucket, and with parameters on NVMe
    the parameter pool's share of the host budget (offload/budget.py); and which units
    merge as persistent (stage3_param_persistence_threshold)."""
    pool = OffloadPolicy.from_config(config).pool_unit_numel(compute_dtype.itemsize, shard_world)
    return UnitCaps(bucket_numel, pool,
                    int(config.zero_optimization.stage3_param_persistence_threshold))


def choose_units(module: nn.Module, param_groups: list[dict], fetch_units: tuple[type, ...],
                 caps: UnitCaps, full_numel: Callable[[nn.Parameter], int]) -> UnitChoice:
    """The fetch units of `module` (units.py), split by optimizer param group."""
    group_of = {id(p): gi for gi, pg in enumerate(param_groups) for p in pg["params"]}
    plans = plan_fetch_units(module, fetch_units, caps, full_numel)
    parts, modules = [], []
    for plan in plans:
        for gi in sorted({group_of[id(p)] for p in plan.params if id(p) in group_of}):
            parts.append((gi, [p for p in plan.params if group_of.get(id(p)) == gi]))
            modules.append(plan.modules)
    names = {id(m): n for n, m in module.named_modules()}
    target = default_target(unmerged_units(module, full_numel), caps)
    report = describe(plans, names, fetch_units, target)
    log.info("%s", report)
    return UnitChoice(parts, modules, report)


def build_stage3(module: nn.Module, groups: list[FlatParamGroup], choice: UnitChoice,
                 config: Config, plan: CommPlan, placement: ParamPlacement,
                 gather_timeout_s: float | None, comm: Comm, zero: ZeroOptimizer,
                 partitions: Partitions) -> FetchSchedule:
    """One ShardedUnit per flat group (small ones stay whole: persistent), and their schedule."""
    settings = config.zero_optimization
    index_of = {id(g.params[0]): i for i, g in enumerate(groups)}  # the reducer's launch order
    live = LiveStats()
    module_units = []
    for modules, (_, params) in zip(choice.modules, choice.parts):
        index = index_of[id(params[0])]
        group = groups[index]
        persistent = group.numel < settings.stage3_param_persistence_threshold
        unit = ShardedUnit(group, index, zero, plan.shard, persistent, live, placement,
                           plan.gather)
        module_units += [(m, unit) for m in modules]
    explicit = "stage3_prefetch_bucket_size" in settings.model_fields_set
    prefetch = int(settings.stage3_prefetch_bucket_size) if explicit else derived_prefetch_numel(
        max((g.numel for g in groups), default=0))
    limits = Stage3Limits(placement.prefetch_numel(prefetch, explicit),
                          settings.stage3_max_live_parameters,
                          settings.stage3_max_reuse_distance, gather_timeout_s)
    schedule = FetchSchedule(module, module_units, limits, live, comm, comm.store, placement)
    zero.after_gather(schedule.refresh)  # persistent units re-gather the new weights
    partitions.add_units(schedule.units)  # GatheredParameters finds them there
    return schedule
