"""Which parameters are gathered together at stage 3: the fetch-unit policy.

Every stage-3 gather costs a collective, a buffer, two hooks and some Python,
whatever its size; on a model of many small layers that fixed cost, not the
bytes, sets the step time (issue 15). So by default units are chosen to
amortise it, in three passes over the module tree (ZeRO paper section 5.3 fetches
"per module"; FSDP1's size-based wrap policy and DeepSpeed's
`stage3_prefetch_bucket_size` batch small modules the same way):

1. **Repeated blocks.** The children of a `ModuleList` / `Sequential` whose
   children (two or more) are all of one class, e.g. transformer layers, each
   become one unit holding every parameter below them. Outermost wins: the
   inside of a block is not searched again. Every other parameter belongs to
   the module that registers it.
2. **Coalescing.** Walking units in module order (usually forward order),
   neighbours are merged while the merged unit stays within
   `clamp(psi // 8, 2**16, 2**22)` elements: about eight units or more per
   model, none so large that gathering it costs more memory than a block; and
   within `reduce_bucket_size`, since a unit's gradients are reduce-scattered as
   one bucket (the constant buffers, CB, stay as the user sized them); and, with
   parameters on NVMe, within the parameter pool's share of the host budget
   (offload/budget.py `pool_unit_numel`): the pool holds `buffer_count` shards of
   the largest unit, so merging by psi/8 would grow it with the model (issue 16).
   Merging up to the largest unmerged unit costs that pool nothing.
   A unit holding a parameter registered by two modules (a tied embedding and
   head) is never merged: its other user runs elsewhere in the pass, and should
   gather only what it reads.
3. **Persistent units together.** Units under `stage3_param_persistence_threshold`
   stay whole between optimizer steps, so no pass gathers them; wherever they sit,
   they are merged while the merged unit stays under the threshold (so it stays
   persistent): one reduce-scatter and one all-gather a step for several of them
   (`merge_persistent`).

Leaf modules (`zero_optimization.leaf_module`, and DeepSpeed's `set_z3_leaf_modules`;
config/leaf_modules.py) are never split: a leaf outside a block is a unit of its own (the
default policy may merge it with neighbours, never cut it), so a sparse MoE block's
experts, which each rank runs as its data picks, are gathered together on every rank.

With `fetch_units` (module classes) the user's choice wins: every instance of
those classes is one unit, the rest go to the module owning them, nothing is
merged. Either way every trainable parameter is in exactly one unit, and a unit
lists every module that registers one of its parameters (the hooks gather it
when any of them runs).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from torch import nn

log = logging.getLogger("zeromem")

MIN_UNIT_NUMEL = 2 ** 16
MAX_UNIT_NUMEL = 2 ** 22


@dataclass
class UnitPlan:
    """One fetch unit to build: its parameters and the modules whose hooks gather it."""

    params: list[nn.Parameter]
    modules: list[nn.Module]
    kind: str  # "block", "module" or "user" (a `fetch_units` instance); "+" joined if merged
    numel: int  # elements of `params` whole (also while `Init` holds only their shards)
    shared: bool = False  # holds a parameter registered by two modules (tied)


@dataclass(frozen=True)
class UnitCaps:
    """What bounds a merged unit besides the model's size, in elements (None: nothing)."""

    bucket_numel: int | None = None  # reduce_bucket_size: a unit is reduced as one bucket
    pool_numel: int | None = None  # NVMe parameters: the parameter pool's share of the budget
    # stage3_param_persistence_threshold: smaller units stay whole between steps, so they
    # are merged wherever they are, into units still under it (`merge_persistent`)
    persistent_numel: int = 0

    def fits_persistent(self, numel: int) -> bool:
        """May `merge_persistent` make a unit of `numel` elements? Under the threshold (so
        the engine keeps it whole, as the planner predicts), within the bucket and pool."""
        return numel < self.persistent_numel and all(
            cap is None or numel <= cap for cap in (self.bucket_numel, self.pool_numel))


def coalesce_target_numel(psi: int, caps: UnitCaps = UnitCaps(), largest_numel: int = 0) -> int:
    """Largest merged unit, in elements, for a model of `psi` trainable elements whose
    largest unmerged unit has `largest_numel` (the parameter pool holds that one anyway)."""
    target = max(MIN_UNIT_NUMEL, min(MAX_UNIT_NUMEL, psi // 8))
    if caps.bucket_numel is not None:
        target = min(target, caps.bucket_numel)
    if caps.pool_numel is not None:
        target = min(target, max(caps.pool_numel, largest_numel))
    return target


def _trainable(p: nn.Parameter) -> bool:
    return p.requires_grad


def plan_fetch_units(root: nn.Module, unit_classes: tuple[type, ...] = (),
                     caps: UnitCaps = UnitCaps(),
                     numel_of: Callable[[nn.Parameter], int] = nn.Parameter.numel,
                     sharded: Callable[[nn.Parameter], bool] = _trainable,
                     leaves: Sequence[nn.Module] = ()) -> list[UnitPlan]:
    """The fetch units of `root`, in module order; each parameter `sharded` names (by
    default the trainable ones) in exactly one.

    `caps` bound a merged unit (nothing is merged when `unit_classes` are given);
    `numel_of` counts a parameter whole (`Partitions.full_numel` for a model built
    under `Init`); `leaves` are never split (the default policy's)."""
    if not unit_classes:
        units = unmerged_units(root, numel_of, sharded, leaves)
        return merge_persistent(coalesce(units, default_target(units, caps)), caps)
    claim = _Claims(_holders(root), numel_of, sharded)
    for module in leaves:  # first: nothing below a leaf is a unit of its own
        claim.take(module, recurse=True, kind="leaf")
    for module in root.modules():
        if isinstance(module, unit_classes) and module is not root:
            claim.take(module, recurse=True, kind="user")
    for module in root.modules():
        claim.take(module, recurse=False, kind="module")
    return claim.units


def unmerged_units(root: nn.Module,
                   numel_of: Callable[[nn.Parameter], int] = nn.Parameter.numel,
                   sharded: Callable[[nn.Parameter], bool] = _trainable,
                   leaves: Sequence[nn.Module] = ()) -> list[UnitPlan]:
    """The default policy's units before coalescing: blocks and leaves, then each
    module's own."""
    claim = _Claims(_holders(root), numel_of, sharded)
    _claim_blocks(root, claim, {id(m) for m in leaves})
    return claim.units


def default_target(units: list[UnitPlan], caps: UnitCaps) -> int:
    """`coalesce_target_numel` for these unmerged units."""
    numels = [u.numel for u in units]
    return coalesce_target_numel(sum(numels), caps, max(numels, default=0))


def _holders(root: nn.Module) -> dict[int, list[nn.Module]]:
    """Parameter id -> every module that registers it (two or more: a tied parameter)."""
    holders: dict[int, list[nn.Module]] = {}
    for module in root.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(module)
    return holders


class _Claims:
    """Hands each parameter to be sharded to the first unit that takes it."""

    def __init__(self, holders: dict[int, list[nn.Module]],
                 numel_of: Callable[[nn.Parameter], int], sharded: Callable[[nn.Parameter], bool]):
        self.holders = holders
        self.numel_of = numel_of
        self.sharded = sharded
        self.claimed: set[int] = set()
        self.units: list[UnitPlan] = []

    def take(self, module: nn.Module, recurse: bool, kind: str) -> None:
        params = [p for p in module.parameters(recurse=recurse)
                  if self.sharded(p) and id(p) not in self.claimed]
        if not params:
            return
        self.claimed.update(id(p) for p in params)
        modules = [module]
        tied = [p for p in params if len(self.holders[id(p)]) > 1]
        for p in tied:  # a tied parameter's other holders gather this unit too
            modules += [m for m in self.holders[id(p)] if all(m is not k for k in modules)
                        and not _is_below(m, module)]
        numel = sum(self.numel_of(p) for p in params)
        self.units.append(UnitPlan(params, modules, kind, numel, shared=bool(tied)))


def _is_below(module: nn.Module, ancestor: nn.Module) -> bool:
    """`module` runs inside `ancestor` (so `ancestor`'s hooks already gather for it)."""
    return any(m is module for m in ancestor.modules())


def _is_repeated(module: nn.Module) -> bool:
    """A ModuleList / Sequential of two or more children of one class."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    kinds = {type(child) for child in module.children()}
    return len(module) >= 2 and len(kinds) == 1


def _claim_blocks(module: nn.Module, claim: _Claims, leaves: set[int]) -> None:
    """Pre-order: a module's own parameters, then its children (blocks and leaves whole)."""
    if id(module) in leaves:
        claim.take(module, recurse=True, kind="leaf")
        return
    claim.take(module, recurse=False, kind="module")
    repeated = _is_repeated(module)
    for child in module.children():
        if repeated:
            claim.take(child, recurse=True, kind="block")
        else:
            _claim_blocks(child, claim, leaves)


def merge_runs(numels: Sequence[int], shared: Sequence[bool], target_numel: int) -> list[range]:
    """Index runs of neighbours merged while a run stays within `target_numel`; a shared
    (tied) unit is a run of its own. Pure arithmetic, shared with the planner."""
    runs: list[range] = []
    total = 0
    for i, (numel, tied) in enumerate(zip(numels, shared)):
        last = runs[-1] if runs else None
        if (last is not None and not tied and not shared[last.start]
                and total + numel <= target_numel):
            runs[-1] = range(last.start, i + 1)
            total += numel
        else:
            runs.append(range(i, i + 1))
            total = numel
    return runs


def coalesce(units: list[UnitPlan], target_numel: int) -> list[UnitPlan]:
    """Merge neighbours while the merged unit stays within `target_numel`; tied units alone."""
    runs = merge_runs([u.numel for u in units], [u.shared for u in units], target_numel)
    return [units[run.start] if len(run) == 1 else _merged(units[run.start:run.stop])
            for run in runs]


def _merged(units: list[UnitPlan]) -> UnitPlan:
    kind = units[0].kind
    for unit in units[1:]:
        kind = kind if kind.endswith(unit.kind) else f"{kind}+{unit.kind}"
    return UnitPlan([p for u in units for p in u.params], [m for u in units for m in u.modules],
                    kind, sum(u.numel for u in units))


def persistent_groups(numels: Sequence[int], caps: UnitCaps) -> list[list[int]]:
    """Units (by index, in order) after `merge_persistent`: the units under the persistence
    threshold packed in order while a pack `fits_persistent`, each pack where its first
    member was; the others alone. Pure arithmetic, shared with the planner."""
    groups: list[list[int]] = []
    pack: list[int] | None = None
    total = 0
    for i, numel in enumerate(numels):
        if not caps.fits_persistent(numel):
            groups.append([i])
        elif pack is not None and caps.fits_persistent(total + numel):
            pack.append(i)
            total += numel
        else:
            pack, total = [i], numel
            groups.append(pack)
    return groups


def merge_persistent(units: list[UnitPlan], caps: UnitCaps) -> list[UnitPlan]:
    """Units under the persistence threshold merged, wherever they are in the model.

    A persistent unit stays whole from one optimizer step to the next: no pass gathers
    it, so where it runs does not matter, only that each unit costs a step one
    reduce-scatter and one all-gather (on a tiny model, most of stage 3's collectives)."""
    groups = persistent_groups([u.numel for u in units], caps)
    return [units[g[0]] if len(g) == 1 else _persistent([units[i] for i in g]) for g in groups]


def _persistent(units: list[UnitPlan]) -> UnitPlan:
    return UnitPlan([p for u in units for p in u.params], [m for u in units for m in u.modules],
                    "persistent", sum(u.numel for u in units), any(u.shared for u in units))


def describe(units: list[UnitPlan], names: dict[int, str], user_classes: tuple[type, ...],
             target_numel: int = 0) -> str:
    """One line per unit for the run report: size, kind and the modules it spans;
    `target_numel`: the merge target the default policy used (`default_target`)."""
    if user_classes:
        policy = "user fetch_units " + ", ".join(c.__name__ for c in user_classes)
    else:
        policy = f"default: repeated blocks, neighbours merged up to {target_numel:,} elements"
    lines = [f"stage-3 fetch units ({policy}): {len(units)}"]
    for i, unit in enumerate(units):
        first, last = names.get(id(unit.modules[0]), "?"), names.get(id(unit.modules[-1]), "?")
        span = first if len(unit.modules) == 1 else f"{first} .. {last}"
        lines.append(f"  {i:3d} {unit.numel:>12,}  {unit.kind:<14} {span or '(root)'}")
    return "\n".join(lines)


@dataclass(frozen=True)
class UnitChoice:
    """The fetch units chosen for a model, as flat groups to build."""

    parts: list[tuple[int, list[nn.Parameter]]]  # (param group index, parameters) per group
    modules: list[list[nn.Module]]  # per part: the modules whose hooks gather it
    report: str  # one line per unit, for the run report (`describe`)


def choose_units(module: nn.Module, param_groups: list[dict], fetch_units: tuple[type, ...],
                 caps: UnitCaps, full_numel: Callable[[nn.Parameter], int],
                 frozen: Sequence[Sequence[nn.Parameter]] = (),
                 leaves: Sequence[nn.Module] = ()) -> UnitChoice:
    """The fetch units of `module`, split by optimizer param group: the engine builds one
    flat group per part, before the stage-3 units (fetch.py `build_stage3`) exist.

    `frozen` parameters (a training engine's, frozen at `initialize`) get units of their
    own, chosen by the same policy, each list of them (one per dtype kept) as parts of
    param group `len(param_groups)` on: sharded like the others, with nothing to train (a
    block's LoRA adapters and its frozen weights are two units its hooks gather together)."""
    group_of = {id(p): gi for gi, pg in enumerate(param_groups) for p in pg["params"]}
    group_of.update({id(p): len(param_groups) + k for k, ps in enumerate(frozen) for p in ps})
    parts: list[tuple[int, list[nn.Parameter]]] = []
    modules: list[list[nn.Module]] = []
    names = {id(m): n for n, m in module.named_modules()}
    reports = []
    frozen_ids = {id(p) for ps in frozen for p in ps}
    for kept in ((lambda p: id(p) in group_of and id(p) not in frozen_ids),  # (an evaluating
                 (lambda p: id(p) in frozen_ids)):                          # engine's frozen too)
        plans = plan_fetch_units(module, fetch_units, caps, full_numel, kept, leaves)
        for plan in plans:
            for gi in sorted({group_of[id(p)] for p in plan.params}):
                parts.append((gi, [p for p in plan.params if group_of[id(p)] == gi]))
                modules.append(plan.modules)
        if plans:
            target = default_target(unmerged_units(module, full_numel, kept, leaves), caps)
            reports.append(describe(plans, names, fetch_units, target))
    report = "\nfrozen parameters: ".join(reports)
    log.info("%s", report)
    return UnitChoice(parts, modules, report)
