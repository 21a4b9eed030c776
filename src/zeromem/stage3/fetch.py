"""ZeRO-3 (P_os+g+p): parameters partitioned, gathered per module on demand.

Every fetch unit (chosen by units.py: by default repeated blocks and merged
small neighbours, or one per instance of the classes the caller names) is a
`ShardedUnit` (sharded_unit.py): one flat group whose parameters exist only as
a 1/N_d shard between uses, with its all-gather (plain, hpZ or qwZ), its release
and its gradients' reduce-scatter. This module decides when:

    SHARDED --unshard(async)--> GATHERING --wait--> GATHERED --reshard--> SHARDED

Schedule of one training step (paper section 5.3; FSDP2 follows the same plan):

    forward   pre-hook: gather the unit (waiting for a prefetch if one is in
              flight) and prefetch the next units of the recorded order, up to
              `stage3_prefetch_bucket_size` elements; post-hook: release.
    backward  the unit's outputs carry a hook that re-gathers it before its
              gradients are computed; when the unit has counted every gradient
              and handed its reduce-scatter in, it tells the schedule, which
              releases it (readiness is counted by the unit only).
    end       `finish_pass()` releases whatever is still gathered.

The order of units is recorded per kind of pass: training forward, `no_grad`
forward (evaluation, generation) and backward, each also keyed by the module's
train/eval mode and the flag arguments (bool, str, None) of the root call,
which usually choose a branch. If a pass differs from its recorded order (a
conditional branch), prefetching stops for that pass and the order is recorded
again: a unit is always gathered before it is used, so a changed order costs
speed, never correctness.

A parameter used outside the module that owns it (a tied output head reusing
the embedding, `F.linear(x, self.embed.weight)` in a parent) is found by a
TorchFunctionMode that sees which parameters each op reads while a module runs;
that module then gathers the other unit too, from then on. The tracer is on
whenever the order is not known: for the whole of the first pass of each kind,
and from the point where a pass leaves its recorded order to its end. A read
that appears with no change of flags, mode or module order (a branch on data
or on module state) is not seen; pass such a choice as a flag argument.

`torch.compile` (the whole model or each block): the hooks run outside the
compiled region (`torch.compiler.disable`, a graph break at each hook), and a
pass with the tracer on runs eagerly (`set_stance("force_eager")`), because the
tracer must see every op; later passes run compiled.

Outside a gather a partitioned parameter has shape `torch.Size([0])` (as in
DeepSpeed); use `zeromem.GatheredParameters` to read it whole.

Built by `build_stage3` (torchtitan's `apply_*(model, config)` style: the config and
the parts are passed in, nothing is read from the engine), once the flat groups, the
parameter placement (offload/params.py) and the gradient buckets' launch order
(`Comm.schedule_reductions`, comm.py) exist: one
`ShardedUnit` per flat group, the prefetch window, and the schedule; `GatheredParameters`
finds the units through `partitions`. The units were chosen before the groups were
built (units.py `choose_units`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from zeromem.comm import Comm
from zeromem.config.schema import Config
from zeromem.flat import FlatParamGroup, GroupState
from zeromem.layout import derived_prefetch_numel
from zeromem.lockstep import Lockstep
from zeromem.offload.params import ParamPlacement, ParamsOnDevice
from zeromem.stage3.partitioned_init import Partitions
from zeromem.stage3.sharded_unit import LiveStats, Phase, ShardedUnit
from zeromem.stage3.units import UnitChoice

if TYPE_CHECKING:  # the engine builds the plan and passes it in
    from zeromem.hybrid.hierarchy import CommPlan


class Stage3DivergenceError(RuntimeError):
    """Ranks stopped running the same gathers (one ran a forward the others did not)."""


@dataclass(frozen=True)
class Stage3Limits:
    """The stage-3 knobs of `zero_optimization`, in elements (and seconds)."""

    prefetch_numel: int = 50_000_000        # stage3_prefetch_bucket_size
    max_live_numel: int = 1_000_000_000     # stage3_max_live_parameters (bounds prefetch)
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance
    gather_timeout_s: float | None = None   # a gather waiting longer is a divergence


class _BackwardHook(torch.autograd.Function):
    """Identity whose backward calls `hook(module_id)`: on a module's outputs, before their
    gradients flow into it (gather its units: `before_backward`); on its inputs, once
    backward has gone through it (release the frozen units it read: `after_backward`,
    FSDP2's post-backward hook).

    Autograd runs ready nodes latest-created first, and the hook on the inputs is created
    before anything the module computes, so the module's own nodes have run when it
    does. A module called again later re-gathers through the hook on its outputs."""

    @staticmethod
    def forward(ctx, hook: Callable[[int], None], module_id: int, *tensors):
        ctx.hook, ctx.module_id = hook, module_id
        views = tuple(t.view_as(t) for t in tensors)
        return views if len(views) > 1 else views[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook(ctx.module_id)
        return (None, None, *grads)


class _ParamUseTracer(TorchFunctionMode):
    """Records which units' parameters each running module reads (passes of unknown order)."""

    def __init__(self, runner: "FetchSchedule"):
        super().__init__()
        self.runner = runner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        runner = self.runner
        if runner.module_stack and not runner.busy:
            for a in list(args) + list(kwargs.values()):
                unit = runner.unit_of_param.get(id(a)) if isinstance(a, nn.Parameter) else None
                if unit is not None and unit.state is not GroupState.GATHERED:
                    unit.wait()  # gathered on demand now; recorded for the next passes
                    runner.extra_units.setdefault(runner.module_stack[-1], []).append(unit)
        return func(*args, **kwargs)


class _Tracing:
    """The tracer and the eager stance it needs, entered and left as one (the root's pass)."""

    def __init__(self, runner: FetchSchedule):
        self.tracer = _ParamUseTracer(runner)
        self.eager = None

    def enter(self) -> _Tracing:
        # compiled code would run ops the tracer cannot see: eager for the rest of this pass
        self.eager = torch.compiler.set_stance("force_eager")  # takes effect when made
        self.tracer.__enter__()
        return self

    def exit(self) -> None:
        self.tracer.__exit__(None, None, None)
        if self.eager is not None:
            self.eager.__exit__(None, None, None)


class RecordedOrder:
    """The units one kind of pass used, in order, with O(1) look-ups for the schedule:
    elements from one position to another (prefetch window, reuse distance) and the
    next position that uses the same unit. Built once per recording, not per hook."""

    def __init__(self, units: list[ShardedUnit]):
        self.units = units
        # elements of the prefetch window: persistent units are whole anyway, count nothing
        self.ahead = list(accumulate((0 if u.persistent else u.group.padded_numel
                                      for u in units), initial=0))
        self.next_use = [len(units)] * len(units)
        seen: dict[int, int] = {}
        for i in range(len(units) - 1, -1, -1):
            self.next_use[i] = seen.get(id(units[i]), len(units))
            seen[id(units[i])] = i

    def __len__(self) -> int:
        return len(self.units)

    def numel_between(self, start: int, end: int) -> int:
        return self.ahead[end] - self.ahead[start]


def _branch_flags(args: tuple, kwargs: dict) -> tuple:
    """The flag arguments of a root call (bool, str, None): what usually picks a branch."""
    flag = (bool, str, type(None))
    return (tuple((i, a) for i, a in enumerate(args) if isinstance(a, flag))
            + tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, flag))))


class FetchSchedule:
    """Installs the gather/release hooks on a module tree and runs the prefetch schedule."""

    def __init__(self, root: nn.Module, module_units: list[tuple[nn.Module, ShardedUnit]],
                 limits: Stage3Limits, stats: LiveStats, comm: Comm, store=None,
                 placement: ParamPlacement | None = None, lockstep: Lockstep | None = None,
                 outside_gradient: Callable[[torch.Tensor], None] | None = None):
        # a unit may be gathered by several modules (merged neighbours, a tied parameter)
        self.units = list({id(u): u for _, u in module_units}.values())
        self.placement = placement or ParamsOnDevice()  # told the order of each pass (read-ahead)
        # A persistent unit is whole from one optimizer step to the next (`refresh`): its
        # modules have nothing to gather, and are hooked only like modules without units.
        self.unit_of_module: dict[int, list[ShardedUnit]] = {}
        for module, unit in module_units:
            if not unit.persistent:
                self.unit_of_module.setdefault(id(module), []).append(unit)
        self.unit_of_param = {id(p): u for u in self.units for p in u.group.params}
        self.extra_units: dict[int, list[ShardedUnit]] = {}  # module id -> other units it reads
        self.limits = limits
        self.stats = stats
        self.comm = comm
        self.store = store
        self.lockstep = lockstep  # the engine's ranks' common log (lockstep.py)
        self.outside_gradient = outside_gradient  # told of one outside the engine's backward
        self.grad_factor = 1.0  # this backward's (`start_pass`)
        self.passes = 0
        self.module_stack: list[int] = []
        # orders by kind of pass: ("forward" | "eval" | "backward", training, flags)
        self.orders: dict[tuple, list[ShardedUnit]] = {}
        self.recorded: dict[tuple, RecordedOrder] = {}
        self.pass_kind: tuple = ("forward", root.training, ())
        self.position = 0
        self.frontier = 0  # prefetch issued up to here in the recorded order
        self.used_at: dict[int, int] = {}  # unit id -> its latest position in this pass
        self.on_track = True
        self.in_pass = False  # between the root's pre-forward (or engine.backward) and its end
        self.release_queued = False  # another engine's backward gathered: released at its end
        self.tracing: _Tracing | None = None  # on while this pass's order is not known
        self.busy = False  # inside our own hooks: the tracer must not see our tensor ops
        self.root = root
        self.persistent_released = False  # `release_all` dropped them since the last forward
        self.handles = [root.register_forward_pre_hook(self._start_forward, with_kwargs=True)]
        # Modules that gather something are hooked for good; the others only while the
        # tracer needs to know which module runs (each hook costs a few microseconds).
        self.module_hooks: dict[int, list] = {}
        self.idle_hooked = False
        for module in root.modules():
            if module is root or id(module) in self.unit_of_module:
                self._hook_module(module)
        for unit in self.units:  # each unit counts its own gradients; released once reduced
            self.handles += [p.register_post_accumulate_grad_hook(partial(self._grad_in, unit))
                             for p in unit.group.params if p.requires_grad]  # (not an
            # evaluating engine's frozen ones: they get no gradient)
        self.refresh()

    def refresh(self) -> None:
        """After the optimizer step: persistent units re-gather, the others drop to shards."""
        for unit in self.units:
            unit.new_step()  # hpZ's secondary copies hold the old weights
            unit.reshard(force=True)
        self._gather_persistent()

    def _gather_persistent(self) -> None:
        self.persistent_released = False
        persistent = [u for u in self.units if u.persistent]
        for unit in persistent:  # every re-gather in flight at once, then wait for each
            unit.unshard()
        for unit in persistent:
            unit.wait()

    def release_all(self) -> None:
        """Every unit not pinned by GatheredParameters back to its shard, persistent ones
        too (gathered again when the next forward starts): DeepSpeed's
        `empty_partition_cache`, which RLHF loops call after generation to give the memory
        back."""
        for unit in self.units:
            if not unit.pins:
                unit.reshard(force=True)
        self.persistent_released = True  # no hook gathers them: the next forward's start does

    # -- hooks on modules -------------------------------------------------------
    def _hook_module(self, module: nn.Module) -> None:
        self.module_hooks[id(module)] = [module.register_forward_pre_hook(self._pre_forward),
                                         module.register_forward_hook(self._post_forward)]

    def _hook_idle_modules(self) -> None:
        """Hook every module, so the tracer knows which one reads a parameter."""
        if not self.idle_hooked:
            for module in self.root.modules():
                if id(module) not in self.module_hooks:
                    self._hook_module(module)
            self.idle_hooked = True

    def _unhook_idle_modules(self) -> None:
        """Drop the hooks of modules that gather nothing (kept: those that read other units)."""
        if self.idle_hooked:
            keep = {id(self.root), *self.unit_of_module, *self.extra_units}
            for key in [k for k in self.module_hooks if k not in keep]:
                for handle in self.module_hooks.pop(key):
                    handle.remove()
            self.idle_hooked = False

    # -- passes ------------------------------------------------------------
    def start_pass(self, kind: str | tuple, grad_factor: float = 1.0) -> None:
        """Begin a pass ("backward", or a forward's full key): reset the position in its order.

        A backward is keyed like the forward before it (same mode and flags, same branch);
        its gradients are taken in times `grad_factor` (zero_optimizer.py `start_backward`).
        """
        self.grad_factor = grad_factor
        key = ("backward", *self.pass_kind[1:]) if kind == "backward" else tuple(kind)
        self.pass_kind, self.position, self.on_track = key, 0, key in self.recorded
        self.frontier, self.in_pass = 0, True
        self.used_at.clear()
        for unit in self.units:
            unit.start_pass(Phase(key[0]))  # how it gathers: backward from hpZ's copy
        if key[0] != "backward":
            self.passes += 1
            if self.store is not None:  # published so a stuck rank can name who diverged
                self.store.set(f"zeromem/stage3/passes/{self.comm.rank}", str(self.passes))
            if self.lockstep is not None and self.unit_of_module:  # it gathers: collective
                mode = "training" if key[1] else "evaluation"
                grads = "" if torch.is_grad_enabled() else ", without gradients"
                self.lockstep.pass_starts(f"forward {self.passes} ({mode} mode{grads})")
        self.orders[key] = []
        recorded = self.recorded.get(key)
        self.placement.follow(recorded.units if recorded else None)  # None: a new kind

    def finish_pass(self) -> None:
        """Release every unit still gathered and keep this pass's order for prefetching."""
        kind = self.pass_kind
        order = self.orders[kind]
        # An empty order is recorded too (every unit persistent): a kind never recorded
        # would keep the tracer on in each of its passes.
        if not self.on_track or len(order) != len(self.recorded[kind]):  # new or changed
            self.recorded[kind] = RecordedOrder(order)
            self.placement.follow(order)
        self.in_pass = self.on_track = False
        for unit in self.units:
            unit.reshard()
            if kind[0] == "backward":
                unit.start_pass(Phase.FORWARD)  # between passes: gradients now are not ours

    def _start_tracing(self) -> None:
        """Watch which parameters each op reads until the root's forward ends."""
        if self.tracing is None and self.pass_kind[0] != "backward" and self.module_stack:
            self._hook_idle_modules()
            self.tracing = _Tracing(self).enter()

    def _stop_tracing(self) -> None:
        if self.tracing is not None:
            self.tracing.exit()
            self.tracing = None

    def _use(self, units: list[ShardedUnit]) -> None:
        """Gather `units` for the running module; follow or re-record the order; prefetch."""
        self.busy = True
        try:
            self._follow_order(units)
        finally:
            self.busy = False

    def _follow_order(self, units: list[ShardedUnit]) -> None:
        if not self.in_pass:  # a submodule called on its own (an encoder-decoder's generate
            self._gathers_outside_a_pass(units)  # runs its encoder so): gathered on demand,
            for unit in units:  # nothing recorded
                self._wait(unit)
            return
        expected = self.recorded.get(self.pass_kind)
        for unit in units:
            if self.on_track and (expected is None or self.position >= len(expected)
                                  or expected.units[self.position] is not unit):
                self.on_track = False  # the order changed: gather on demand this pass
                self._start_tracing()  # a new branch may read other modules' parameters
            self.orders[self.pass_kind].append(unit)
            self.used_at[id(unit)] = self.position
            self.position += 1
            self._wait(unit)
        if self.on_track:
            self._prefetch()

    def _gathers_outside_a_pass(self, units: list[ShardedUnit]) -> None:
        """Gathers outside the root's forward are collective calls too: an event of the
        ranks' log (lockstep.py), so that a submodule called on one rank alone is named at
        once, not after the gather timeout. Units already whole gather nothing."""
        sharded = [unit.name for unit in units if unit.state is GroupState.SHARDED]
        if sharded and self.lockstep is not None:
            self.lockstep.pass_starts(f"a gather of {', '.join(map(repr, sharded))} outside "
                                      "a forward of the model (a submodule called on its own)")

    def _wait(self, unit: ShardedUnit) -> None:
        try:
            unit.wait(self.limits.gather_timeout_s)
        except RuntimeError as error:  # timeout, or a peer that closed the connection
            raise Stage3DivergenceError(self._diagnose(unit, error)) from error

    def _diagnose(self, unit: ShardedUnit, error: Exception) -> str:
        """Name the module this rank waits for and the ranks whose pass count differs."""
        here = f"rank {self.comm.rank} waited for the parameters of '{unit.name}' " \
               f"({self.pass_kind} pass {self.passes}, position {self.position})"
        others = self.pass_counts()
        behind = [r for r, n in others.items() if n != self.passes]
        who = (f"; rank(s) {behind} are at forward pass(es) {[others[r] for r in behind]}: "
               "they did not run this forward" if behind else "")
        return (f"ZeRO-3 ranks diverged: {here}{who}. Every rank must run the same forward "
                f"and backward under stage 3 (e.g. evaluate on all ranks). Cause: {error}")

    def pass_counts(self) -> dict[int, int]:
        """Forward passes each rank has started, as published in the store (empty if none)."""
        if self.store is None:
            return {}
        counts = {}
        for r in range(self.comm.world_size):
            try:
                counts[r] = int(self.store.get(f"zeromem/stage3/passes/{r}"))
            except RuntimeError:
                counts[r] = 0
        return counts

    def _prefetch(self) -> None:
        """Gather ahead the next units of the recorded order, up to the prefetch window.

        The window counts every unit ahead that is gathered (persistent ones are whole
        anyway and count nothing), whether its gather starts now or at an earlier call.
        Each unit of the order is looked at once per pass: `frontier` moves forward only.
        """
        order = self.recorded[self.pass_kind]
        at = max(self.frontier, self.position)
        while (at < len(order)
               and order.numel_between(self.position, at) < self.limits.prefetch_numel):
            unit = order.units[at]
            if unit.state is GroupState.SHARDED and not unit.persistent:
                if self.stats.live + unit.group.padded_numel > self.limits.max_live_numel:
                    break  # stage3_max_live_parameters: no prefetch past the limit (retried)
                unit.unshard()
            at += 1
        self.frontier = at

    def _reused_soon(self, unit: ShardedUnit) -> bool:
        """Will `unit` be used again within `stage3_max_reuse_distance` elements of this pass?"""
        at = self.used_at.get(id(unit))
        if not self.on_track or at is None:
            return False
        order = self.recorded[self.pass_kind]
        later = order.next_use[at]
        return (later < len(order)
                and order.numel_between(self.position, later) <= self.limits.max_reuse_distance)

    # -- hooks -------------------------------------------------------------
    def _units_for(self, module: nn.Module) -> list[ShardedUnit]:
        return self._units_for_id(id(module))

    # Hooks run outside any compiled region: they swap `p.data` and run collectives,
    # which dynamo must not trace (a graph break at each fetch-unit boundary).
    @torch.compiler.disable
    def _start_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._stop_tracing()  # still on if the last forward raised
        self.module_stack.clear()
        if self.persistent_released:
            self._gather_persistent()
        kind = "forward" if torch.is_grad_enabled() else "eval"
        self.start_pass((kind, module.training, _branch_flags(args, kwargs)))

    @torch.compiler.disable
    def _pre_forward(self, module: nn.Module, args: tuple) -> tuple | None:
        self.module_stack.append(id(module))
        if module is self.root:
            if self.pass_kind not in self.recorded:
                self._start_tracing()  # first pass of this kind: its external reads are unknown
            else:
                self._unhook_idle_modules()  # order known: only gathering modules need hooks
        units = self._units_for(module)
        if units:
            self._use(units)
            if torch.is_grad_enabled() and not all(u.group.trains for u in units):
                return self._hook_after_backward(module, args)
        return None

    @torch.compiler.disable
    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> object:
        if self.module_stack and self.module_stack[-1] == id(module):
            self.module_stack.pop()  # (hooked while it ran: no pre-hook was called for it)
        units = self._units_for(module)
        if units and torch.is_grad_enabled():
            output = self._hook_backward(module, output)
        if units:
            self._release(units)
        if module is self.root:
            self._stop_tracing()
            self.finish_pass()
        return output

    def _release(self, units: list[ShardedUnit]) -> None:
        """Reshard `units` unless a module still running (an ancestor) also reads them."""
        stack = self.module_stack
        in_use = {id(u) for m in stack for u in self._units_for_id(m)} if stack else ()
        self.busy = True
        try:
            for unit in units:
                if id(unit) not in in_use and not self._reused_soon(unit):
                    unit.reshard()
        finally:
            self.busy = False

    def _units_for_id(self, module_id: int) -> list[ShardedUnit]:
        return self.unit_of_module.get(module_id, []) + self.extra_units.get(module_id, [])

    def _hook_backward(self, module: nn.Module, output: object) -> object:
        if isinstance(output, torch.Tensor):  # most blocks: no tree to walk
            return _BackwardHook.apply(self.before_backward, id(module), output) \
                if output.requires_grad else output
        tensors = []
        tree_map(lambda t: tensors.append(t) if torch.is_tensor(t) and t.requires_grad else None,
                 output)
        if not tensors:
            return output
        hooked = _BackwardHook.apply(self.before_backward, id(module), *tensors)
        hooked = hooked if isinstance(hooked, tuple) else (hooked,)
        swap = {id(t): h for t, h in zip(tensors, hooked)}
        return tree_map(lambda t: swap.get(id(t), t) if torch.is_tensor(t) else t, output)

    def _hook_after_backward(self, module: nn.Module, args: tuple) -> tuple | None:
        """Frozen units get no gradient to say when backward is done with them: the module's
        positional inputs carry a hook that does (without one, they go at the end)."""
        tensors = [a for a in args if torch.is_tensor(a) and a.requires_grad]
        if not tensors:
            return None
        hooked = _BackwardHook.apply(self.after_backward, id(module), *tensors)
        hooked = hooked if isinstance(hooked, tuple) else (hooked,)
        swap = {id(t): h for t, h in zip(tensors, hooked)}
        return tuple(swap.get(id(a), a) if torch.is_tensor(a) else a for a in args)

    @torch.compiler.disable
    def after_backward(self, module_id: int) -> None:
        """Backward went through the module: the frozen units it read go (a trained unit
        goes once its gradients are in: `_grad_in`)."""
        self._recompute_ended()
        self._release([u for u in self._units_for_id(module_id) if not u.group.trains])

    @torch.compiler.disable
    def before_backward(self, module_id: int) -> None:
        if not self.in_pass and not self.release_queued:
            # another engine's backward runs through this module: nothing of ours ends it,
            # so what it gathers is released when it ends (FSDP2's final callback)
            self.release_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_foreign_backward)
        self._recompute_ended()
        self._use(self._units_for_id(module_id))

    def _recompute_ended(self) -> None:
        """Autograd calls back between nodes, outside any forward: modules still on the stack
        are those of an activation checkpoint's recomputation, which torch's non-reentrant
        checkpoint stops once it has the tensors it needs, before their post-hooks run.
        Left there, they would keep every unit they read gathered to the end of backward."""
        if self.pass_kind[0] == "backward":
            self.module_stack.clear()

    def _after_foreign_backward(self) -> None:
        self.release_queued = False
        if not self.in_pass:
            for unit in self.units:
                unit.reshard()  # persistent and pinned units stay whole

    def _grad_in(self, unit: ShardedUnit, param: torch.Tensor) -> None:
        """`param`'s gradient was accumulated: the unit counts it; once every gradient
        of the unit is in its reduce bucket, the whole buffer can go."""
        self._recompute_ended()
        if unit.phase in (Phase.FORWARD, Phase.EVAL) and self.outside_gradient is not None:
            self.outside_gradient(param)  # not this engine's backward: it stays in param.grad
        elif self.grad_factor != 1.0 and unit.phase is Phase.BACKWARD and param.grad is not None:
            param.grad.mul_(self.grad_factor)
        if unit.grad_in(param):
            self._release([unit])

    def finish_backward(self) -> None:
        """Units some gradients never reached hand in what they have (before the engine
        waits for the reductions)."""
        for unit in self.units:
            unit.finish_backward()

    def remove(self) -> None:
        for h in self.handles + [h for hs in self.module_hooks.values() for h in hs]:
            h.remove()


def build_stage3(module: nn.Module, groups: list[FlatParamGroup], choice: UnitChoice,
                 config: Config, plan: CommPlan, placement: ParamPlacement,
                 gather_timeout_s: float | None, comm: Comm,
                 partitions: Partitions, lockstep: Lockstep,
                 outside_gradient: Callable[[torch.Tensor], None]) -> FetchSchedule:
    """One ShardedUnit per flat group (small ones stay whole: persistent), and their schedule."""
    settings = config.zero_optimization
    index_of = {id(g.params[0]): i for i, g in enumerate(groups)}  # the units' launch order
    live = LiveStats()
    lockstep.watch(live.take_order)  # the ranks' log compares the order of their gathers
    module_units = []
    for modules, (_, params) in zip(choice.modules, choice.parts):
        index = index_of[id(params[0])]
        group = groups[index]
        persistent = group.numel < settings.stage3_param_persistence_threshold
        unit = ShardedUnit(group, index, plan.shard, persistent, live, placement,
                           plan.gather)
        module_units += [(m, unit) for m in modules]
    explicit = "stage3_prefetch_bucket_size" in settings.model_fields_set
    prefetch = int(settings.stage3_prefetch_bucket_size) if explicit else derived_prefetch_numel(
        max((g.numel for g in groups), default=0))
    limits = Stage3Limits(placement.prefetch_numel(prefetch, explicit),
                          settings.stage3_max_live_parameters,
                          settings.stage3_max_reuse_distance, gather_timeout_s)
    schedule = FetchSchedule(module, module_units, limits, live, comm, comm.store, placement,
                             lockstep, outside_gradient)
    partitions.add_units(schedule.units, lockstep)  # GatheredParameters finds them there
    return schedule
