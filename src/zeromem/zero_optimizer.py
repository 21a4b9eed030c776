"""The ZeRO optimizer: one gradient's life from backward to the all-gather of the new weights.

`ZeroOptimizer` owns the schedule, as nanochat's `optim.py` does: the reduction
during backward, then the step's phases, in order. The engine calls
`start_backward` / `finish_backward` around each backward and `step()` at each
accumulation boundary; nothing here calls back into the engine, and nothing
calls back into this object.

    backward  reduce     stages 0-2: a post-accumulate-grad hook on every parameter
                         adds its gradient into its group's buffer and frees
                         `param.grad` at once (`hook_parameters`); stage 3: each unit
                         counts its own, fills its bucket when the last is in and
                         hands its launch over itself (stage3/sharded_unit.py).
                         When a bucket (= flat group) is complete, its collective is
                         launched asynchronously while backward goes on, in bucket
                         order on every rank, through the shard group's `Comm` the
                         bucket owners share (`Comm.reduce_in_order`);
                         `finish_backward()` hands in the buckets no
                         hook completed (zeros where no gradient came) and waits.
                         alive: at most `max_buckets` full-size buckets, filling or
                         reducing (1 when reduced shards go to an NVMe file).
    step      1. norm    global L2 norm of the reduced gradients (one all-reduce of a
                         scalar when gradients are sharded); non-finite means overflow.
              2. skip    fp16 overflow on any rank: every rank skips, the scaler lowers
                         the scale (the engine zeroes the gradients).
              3. unscale fp32 master gradients = reduced gradients x (clip / loss scale)
                         (a clip below 1 first undoes what the boundary backward began
                         assuming 1: NVMe, offload/backward_step.py),
                         where the masters live: with nothing offloaded, each group's
                         own transition (flat.py); offloaded, the placement's
                         (offload/placement.py), composed in at construction;
                         alive: grads, masters, one fp32 gradient per master shard.
              4. update  the torch optimizer steps the master shards.
              5. gather  masters are written into the parameter shards (the groups'
                         own transition, or the placements' when offloaded), which are
                         all-gathered in buckets of `allgather_bucket_size` elements;
                         then whoever asked (`after_gather`: the stage-3 schedule) is told.

The gradient buffer kinds (whole all-reduced, whole scattered, shard accumulated)
belong to the flat group (flat.py), chosen once from `Sharding`.

Gradients are summed, not averaged, by the collectives: the engine scales the
loss by 1/(N_d * accumulation steps) before backward, so the sums are means.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from zeromem.flat import SECOND_GRADIENT, FlatParamGroup
from zeromem.layout import GATHER_IN_FLIGHT
from zeromem.offload.nvme import OffloadError

log = logging.getLogger("zeromem")

if TYPE_CHECKING:  # the parts the engine builds and passes in; the planner imports this module
    from zeromem.hybrid.hierarchy import CommPlan
    from zeromem.offload.params import ParamPlacement
    from zeromem.offload.placement import MastersPlacement
    from zeromem.precision import DynamicScaler, NoScaler, StaticScaler
    from zeromem.tensor_parallel import ModelParallelNorm


@dataclass(frozen=True)
class StepSettings:
    """The config values the step reads (zero_optimization and the top level)."""

    gradient_clipping: float = 0.0  # gradient_clipping: max global norm, 0 = off
    allgather_bucket_numel: int = 500_000_000  # allgather_bucket_size, in elements


class ZeroOptimizer:
    """Reduces gradients during backward and runs the optimizer step's phases, in order.

    Built once by the engine from parts chosen at construction: the flat groups,
    the collectives (`plan`: which group shards), where masters and parameter
    shards live (`masters`, `params`: offload/placement.py), the torch optimizer
    over the master shards, the loss scaler and, with tensor parallelism only, the
    model-parallel norm (`mp_norm`; None without). The gradient buckets launch through
    the shard group's `Comm` (`plan.shard`), in bucket order.

    What varies with the configuration is chosen here, once (STYLE: composition, no `if
    offload` in the step): with masters and parameter shards on the device, phases 3 and
    5 are each group's own transitions on its own tensors, and no placement is called;
    offloaded, the placements' verbs. Without tensor parallelism the norm is each group's
    own square.
    """

    def __init__(self, groups: list[FlatParamGroup], plan: CommPlan, masters: MastersPlacement,
                 params: ParamPlacement, optimizer: torch.optim.Optimizer,
                 scaler: NoScaler | StaticScaler | DynamicScaler,
                 mp_norm: ModelParallelNorm | None, settings: StepSettings):
        self.groups = groups
        self.plan = plan
        self.optimizer = optimizer
        self.scaler = scaler
        self.settings = settings
        self.masters_where = masters.where  # "device", "host" or "nvme"
        # the norm's square of a group, and its sum over the model-parallel group (TP only)
        self.square: Callable[[FlatParamGroup], torch.Tensor] = \
            _own_square if mp_norm is None else mp_norm.square
        self.sum_over_model: Callable[[torch.Tensor], None] = \
            _alone if mp_norm is None else mp_norm.all_reduce
        # step phases 3 and 5, and what the placement hears at each backward's start
        on_device = masters.where == "device" and params.where == "device"
        self.start_placement: Callable[[bool], None] = \
            _nothing_placed if on_device else masters.start_backward
        self.unscale: Callable[[list[FlatParamGroup], float], None] = \
            _unscale_on_device if on_device else masters.unscale_grads
        self.write_back: Callable[[list[FlatParamGroup]], None] = \
            _write_back_on_device if on_device else partial(masters.write_back, params=params)
        self.refresh: Callable[[list[FlatParamGroup]], None] = \
            _write_back_on_device if on_device else partial(masters.refresh, params=params)
        # a skipped (or clipped) step undoes what the boundary backward began (the NVMe step,
        # which may begin there when no phase before the update needs the whole gradient: no
        # loss scale, no model-parallel norm reading gradients back, and with clipping a
        # coefficient of 1 expected, as the last step's was: `_predict`)
        self.skip: Callable[[], None] = _nothing_begun if on_device else masters.skip_step
        self.allow_step_in_backward: Callable[[bool, bool], None] = \
            _nothing_begins if on_device or mp_norm is not None or scaler.scale != 1.0 \
            or scaler.dynamic else masters.allow_step_in_backward
        self._predict(clipped=False)
        # the shard group's collectives; its bucket order and in-flight bound are shared
        # with the stage-3 units (comm.py `schedule_reductions`)
        self.comm = plan.shard
        self.grad_norm: float | None = None  # pre-clip global norm of the last step
        # the reduced gradients are a whole window's: from the boundary backward's end to
        # zero_grad (what param_states.py reads; mid-window they are a partial sum)
        self.gradient_complete = False
        self._boundary = False
        self._in_backward = False  # between start_backward and finish_backward
        self._backwards = 0  # this engine's backwards so far (warn_outside_backward reads it)
        self._warned_outside = False
        self.missing: list[int] = [len(g.params) for g in groups]  # `hook_parameters` counts
        self.gathered_callbacks: list[Callable[[], None]] = []
        self.hooks: list = []
        self.grad_factor = 1.0  # this backward's, `start_backward`

    # -- backward: reduce -------------------------------------------------------
    def hook_parameters(self) -> None:
        """Stages 0-2: a hook per parameter adds its gradient into its group's buffer and
        counts readiness. (At stage 3 each unit counts its own: stage3/sharded_unit.py.)"""
        for gi, g in enumerate(self.groups):
            for p, slot in zip(g.params, g.slots):
                self.hooks.append(p.register_post_accumulate_grad_hook(self._hook(gi, slot.offset)))

    def _hook(self, gi: int, offset: int):
        def on_grad(param: nn.Parameter) -> None:
            group = self.groups[gi]
            if not self._in_backward:  # another engine's backward through this module:
                self.warn_outside_backward(param)  # `_take_left_over`; or a plain one
                return
            if self.comm.launched(gi):
                name = next(s.name for s in group.slots if s.offset == offset)
                raise RuntimeError(f"parameter {name!r} {SECOND_GRADIENT}")
            if self.missing[gi] == len(group.params):  # a bucket starts
                self.comm.bucket_starts()
            assert param.grad is not None  # a post-accumulate-grad hook
            if self.grad_factor != 1.0:
                param.grad.mul_(self.grad_factor)
            group.add_grad(offset, param.grad)
            param.grad = None
            self.missing[gi] -= 1
            if self.missing[gi] == 0:
                self.comm.reduce_in_order(gi, group.launch_reduction)
        return on_grad

    def after_gather(self, callback: Callable[[], None]) -> None:
        """Call `callback()` each time the updated parameter shards were all-gathered."""
        self.gathered_callbacks.append(callback)

    def start_backward(self, boundary: bool, grad_factor: float = 1.0) -> None:
        """Called before each backward; `boundary` marks the last micro-step of a step.
        Gradients are taken in times `grad_factor` (not 1 where the engine could not scale
        the loss: a `loss.backward()` of the caller's, torch_backward.py)."""
        self.grad_factor = grad_factor
        self.start_placement(boundary)  # offloaded: host copies of reduced grads at the boundary
        self._boundary = boundary
        self.gradient_complete = False
        every_micro = bool(self.groups) and self.groups[0].reduces_every_microstep
        self.comm.start_reductions(boundary or every_micro)
        self.missing = [len(g.params) for g in self.groups]
        self._in_backward = True
        self._backwards += 1

    def finish_backward(self) -> None:
        """Hand in the buckets no hook completed (unused parameters: stages 0-2; stage-3
        units hand in their own before this), then wait for every reduction."""
        if self.hooks:
            for gi, g in enumerate(self.groups):
                if self.missing[gi]:
                    self._take_left_over(gi)
                    self.comm.reduce_in_order(gi, g.launch_reduction)
        self._in_backward = False
        self.comm.finish_reductions()
        self.gradient_complete = self._boundary

    def warn_outside_backward(self, param: torch.Tensor) -> None:
        """A gradient came outside this engine's backward before it ran one of its own:
        another engine's backward through this module (a GAN whose generator trains
        first), or, more likely, a loop written for DDP or FSDP2 (`loss.backward()` and a
        torch optimizer over `model.parameters()`), which would step each rank's own
        unreduced gradient: ranks train apart, silently. Warned once."""
        if self._backwards or self._warned_outside:
            return
        self._warned_outside = True
        name = next((s.name for g in self.groups for q, s in zip(g.params, g.slots)
                     if q is param), "?")
        log.warning("parameter %r got a gradient outside engine.backward(loss), which this "
                    "engine has not run yet: zeromem reduces, scales and applies gradients "
                    "only in engine.backward(loss) and engine.step(); a torch optimizer built "
                    "over model.parameters() after initialize steps each rank's own gradient "
                    "(ranks drift apart) and, at stage 3, empty shards. Pass the optimizer to "
                    "initialize, call the engine rather than the module (loss.backward() on "
                    "its outputs is then its backward) and engine.step() (another engine's "
                    "backward through this module is fine)", name)

    def _take_left_over(self, gi: int) -> None:
        """Gradients still in `param.grad` that no hook of this backward took.

        A backward that is not this engine's (a GAN's generator loss through the
        discriminator's module) leaves them there, as PyTorch does: the user's
        `zero_grad()` drops them, or this engine's next backward takes them in, through
        the hook where that backward accumulates onto them, else here."""
        group = self.groups[gi]
        for p, slot in zip(group.params, group.slots):
            if p.grad is not None:
                if self.missing[gi] == len(group.params):  # a bucket starts
                    self.comm.bucket_starts()
                group.add_grad(slot.offset, p.grad)
                p.grad = None
                self.missing[gi] -= 1

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    # -- the step ------------------------------------------------------------------
    def step(self) -> bool:
        """Phases 1-5 (module docstring); True when fp16 overflow skipped the update."""
        self._refuse_left_over()
        norm = self._global_grad_norm()                          # 1. norm
        overflow = not math.isfinite(norm)
        self.grad_norm = norm
        if not overflow:                                         # 2. skip on overflow
            coef = self._clip_coef(norm)
            if coef < 1.0:  # the step begun in backward assumed 1: redone from the gradients
                self.skip()
            self.unscale(self.groups, coef / self.scaler.scale)  # 3. unscale
            self.optimizer.step()                                # 4. update
            for g in self.groups:
                g.master.grad = None
            self.gather_params()                                 # 5. gather
            self._predict(clipped=coef < 1.0)
        else:
            self.skip()  # what the boundary backward began (offload/backward_step.py)
        self.scaler.update(overflow, self.nonfinite_params)
        return overflow

    def nonfinite_params(self) -> list[str]:
        """The parameters whose part of this rank's reduced gradient holds inf or nan (a
        gradient on NVMe that the step in backward used up is not read)."""
        names = []
        for g in self.groups:
            try:
                grad = g.reduced_grad()
            except OffloadError:  # stepped in the boundary backward and not kept
                continue
            for slot in g.slots:
                start, _, length = g.owned_slice(slot)
                if length > 0 and not bool(torch.isfinite(grad[start:start + length]).all()):
                    names.append(slot.name)
        return names

    def _refuse_left_over(self) -> None:
        """A gradient still in `param.grad` at the step came after this engine's last
        backward from a backward that is not this engine's: this step would leave it
        out (`_take_left_over`), where PyTorch's would count it. Refused, naming it."""
        for g in self.groups:
            for p, slot in zip(g.params, g.slots):
                if p.grad is not None:
                    raise RuntimeError(
                        f"step(): parameter {slot.name!r} has a gradient that no "
                        "engine.backward took in: a loss.backward() through the module "
                        "called directly (call the engine, engine(batch), whose outputs' "
                        "backward is the engine's; or engine.backward(loss)), or another "
                        "engine's backward through "
                        "this module after this engine's last one (zeromem counts it at this "
                        "engine's next backward: call step() before that backward, or "
                        "zero_grad() on the module to drop it)")

    def _predict(self, clipped: bool) -> None:
        """Let the next boundary backward begin the step (NVMe) unless the clip coefficient,
        known only after it, is expected below 1: as the last step's was. With clipping,
        what it steps is a guess: its gradients are kept, and `step` redoes it when wrong."""
        clipping = bool(self.settings.gradient_clipping and self.settings.gradient_clipping > 0)
        self.allow_step_in_backward(not clipped, clipping)

    def _global_grad_norm(self) -> float:
        """L2 norm of the averaged, unscaled gradient of the whole model (padding holds zeros)."""
        if not self.groups:
            return 0.0
        sq = torch.stack([self.square(g) for g in self.groups]).sum()
        if self.groups[0].shard_world > 1:
            self.plan.shard.all_reduce(sq, kind="all_reduce_norm")
        self.sum_over_model(sq)
        return float(sq.sqrt()) / self.scaler.scale

    def _clip_coef(self, norm: float) -> float:
        clip = self.settings.gradient_clipping
        return min(1.0, clip / (norm + 1e-6)) if clip and clip > 0 else 1.0

    def gather_params(self) -> None:
        """Masters into the parameter shards (wherever they live), then all-gather them."""
        self.write_back(self.groups)
        self._all_gather()

    def _all_gather(self) -> None:
        in_flight: deque = deque()
        for g in self.groups:
            for pending in g.launch_all_gather(self.settings.allgather_bucket_numel):
                in_flight.append(pending)
                if len(in_flight) > GATHER_IN_FLIGHT:  # overlap with constant buffers
                    in_flight.popleft().wait()
        for pending in in_flight:
            pending.wait()
        for callback in self.gathered_callbacks:
            callback()

    def zero_grad(self) -> None:
        """Empty every group's gradient buffer (after a step, or a skipped one)."""
        self.gradient_complete = False
        for g in self.groups:
            g.zero_grad()
            for p in g.params:
                p.grad = None

    def set_optimizer_mode(self, mode: str) -> None:
        """A schedule-free optimizer's `train()` or `eval()` (Accelerate calls them for HF's
        Trainer; `mode` names one): they move its masters between the point gradients are
        taken at and the average to evaluate, and the parameters follow, as in one process.
        An optimizer without them: nothing."""
        switch = getattr(self.optimizer, mode, None)
        if not callable(switch):
            return
        if self.masters_where == "nvme":
            raise NotImplementedError(
                f"optimizer.{mode}(): {type(self.optimizer).__name__} moves every master at "
                "once, and with offload_optimizer on NVMe they are read and written a "
                "sub-group at a time in the step only; offload them to \"cpu\" instead")
        switch()
        self.masters_changed()

    def masters_changed(self) -> None:
        """Masters were written outside a step: the compute-dtype parameters follow them."""
        self.refresh(self.groups)
        self._all_gather()

    def refresh_params(self) -> None:
        """After a checkpoint load: compute-dtype parameters from the masters, no stale gradients."""
        self.masters_changed()
        self.zero_grad()


# -- the parts chosen when nothing is offloaded, or no tensor parallelism -------------------
def _own_square(group: FlatParamGroup) -> torch.Tensor:
    """No tensor parallelism: the group's own squared gradient norm is the model's share."""
    return group.grad_square()


def _alone(sq: torch.Tensor) -> None:
    """No model-parallel group: nothing to sum over."""


def _nothing_placed(boundary: bool) -> None:
    """Nothing offloaded: no host copies to arm at the boundary."""


def _nothing_begun() -> None:
    """Nothing offloaded: no step begins before step()."""


def _nothing_begins(allowed: bool, keep_gradients: bool) -> None:
    """Nothing offloaded, or the update needs the loss scale's verdict or the model-parallel
    norm first: no step begins before step()."""


def _unscale_on_device(groups: list[FlatParamGroup], multiplier: float) -> None:
    for g in groups:
        g.unscale_into_master(multiplier)


def _write_back_on_device(groups: list[FlatParamGroup]) -> None:
    for g in groups:
        g.write_back()
