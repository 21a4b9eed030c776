"""The ZeRO optimizer: one gradient's life from backward to the all-gather of the new weights.

`ZeroOptimizer` owns the whole schedule, as nanochat's `optim.py` does: the
reduction during backward, then the step's phases, in order. The engine calls
`start_backward` / `finish_backward` around each backward and `step()` at each
accumulation boundary; nothing here calls back into the engine.

    backward  reduce     stages 0-2: a post-accumulate-grad hook on every parameter
                         adds its gradient into its group's buffer and frees
                         `param.grad` at once (`hook_parameters`); stage 3: each unit
                         counts its own and moves all its gradients into the bucket
                         when the last is in (stage3/sharded_unit.py, `group_ready`).
                         When a bucket (= flat group) is complete, its collective is
                         launched asynchronously while backward goes on.
                         alive: one full-size bucket per collective in flight.
    step      1. norm    global L2 norm of the reduced gradients (one all-reduce of a
                         scalar when gradients are sharded); non-finite means overflow.
              2. skip    fp16 overflow on any rank: every rank skips, the scaler lowers
                         the scale (the engine zeroes the gradients).
              3. unscale fp32 master gradients = reduced gradients x (clip / loss scale),
                         where the masters live (offload/placement.py);
                         alive: grads, masters, one fp32 gradient per master shard.
              4. update  the torch optimizer steps the master shards.
              5. gather  masters are written into the parameter shards, which are
                         all-gathered in buckets of `allgather_bucket_size` elements;
                         then whoever asked (`after_gather`: the stage-3 schedule) is told.

Ranks must issue collectives in the same order even when their graphs differ
(a parameter unused on one rank only), so buckets launch strictly in index order:
a ready bucket waits for the ones before it, and `finish_backward()` launches
whatever is left (a bucket no gradient reached reduces zeros) and waits. At most
`max_buckets` full-size buckets are alive, filling or reducing (BUCKETS_ALIVE by
default; 1 when reduced shards go to an NVMe file, offload/grad_file.py, so that
backward's host memory is one unit's gradient path).

Three gradient buffer kinds, chosen once from `Sharding` (llm.c style: data, not branches):

- `WholeAllReduced`  (stage 0): whole buffer, all-reduced at the boundary.
- `WholeScattered`   (stage 1): whole buffer, reduce-scattered at the boundary;
  the owned chunk of the whole buffer is the reduced shard.
- `ShardAccumulated` (stage 2): only the shard persists, as a view into one
  contiguous buffer shared by all groups (`contiguous_gradients`); a temporary
  full bucket is filled during each micro-step's backward, reduce-scattered,
  added into the shard and dropped.

Gradients are summed, not averaged, by the collectives: the engine scales the
loss by 1/(N_d * accumulation steps) before backward, so the sums are means.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn

from zeromem.comm import Comm, Pending, Reduction, reduce_scatter_copies
from zeromem.flat import FlatParamGroup
from zeromem.layout import BUCKETS_ALIVE, GATHER_IN_FLIGHT

if TYPE_CHECKING:  # the parts the engine builds and passes in; the planner imports this module
    from zeromem.hierarchy import CommPlan
    from zeromem.offload.params import ParamPlacement
    from zeromem.offload.placement import MastersPlacement
    from zeromem.precision import DynamicScaler, NoScaler, StaticScaler
    from zeromem.tensor_parallel import ModelParallelNorm


class GradKind(Protocol):
    """What sizes a gradient kind's communication buffers (class attributes)."""

    temporary_buckets: int
    scatters: bool


def launch_copies(kind: GradKind, backend: str) -> int:
    """Full-size buffers (each as large as the group's bucket) that one launch of a group of
    gradient `kind` holds until it is waited on, all noted in Comm's CB figure: the bucket
    itself when it is a temporary, and the backend's receive buffer when it is
    reduce-scattered (`comm.reduce_scatter_copies`). The planner sizes CB with this."""
    return kind.temporary_buckets + (reduce_scatter_copies(backend) if kind.scatters else 0)


class WholeAllReduced:
    """Stage 0: every rank keeps the whole summed gradient."""

    reduces_every_microstep = False
    temporary_buckets = 0  # full-size buffers a launch holds besides the collective's own
    scatters = False  # all-reduced in place: no receive buffer

    def __init__(self, group: FlatParamGroup, dtype: torch.dtype):
        self.group = group
        self.whole = torch.zeros(group.padded_numel, dtype=dtype, device=group.param_shard.device)

    def accumulate(self, offset: int, grad: torch.Tensor) -> None:
        self.whole[offset:offset + grad.numel()].add_(grad.reshape(-1))

    def launch(self, comm: Comm) -> Pending:
        return comm.all_reduce(self.whole, async_op=True)

    def reduced(self) -> torch.Tensor:
        return self.whole

    def square(self) -> torch.Tensor:
        """The squared L2 norm of `reduced()` (fp32)."""
        return torch.linalg.vector_norm(self.reduced(), dtype=torch.float32) ** 2

    def zero(self) -> None:
        self.whole.zero_()

    def held(self) -> list[torch.Tensor]:
        return [self.whole]


class WholeScattered(WholeAllReduced):
    """Stage 1: the whole gradient accumulates locally; the boundary reduce-scatters it."""

    scatters = True

    def launch(self, comm: Reduction) -> Pending:  # type: ignore[override]  # stage 0's all-reduces
        return comm.reduce_scatter(self.reduced(), self.whole, async_op=True)

    def reduced(self) -> torch.Tensor:
        g = self.group
        return self.whole[g.shard_offset:g.shard_offset + g.shard_numel]


class ContiguousShards:
    """`contiguous_gradients`: every group's reduced shard is a view into one zeroed buffer.

    The buffer is allocated when a shard is first read, not at construction: a placement
    that stores reduced shards elsewhere (offload/grad_file.py) replaces the gradient
    objects before any backward, and then no rank ever holds the model's gradient shard.
    """

    def __init__(self, numels: list[int], dtype: torch.dtype, device: torch.device):
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        self.numels = numels
        self.dtype, self.device = dtype, device
        self.views: list[torch.Tensor] = []  # one per group, always the same tensor

    def shard(self, index: int) -> torch.Tensor:
        if not self.views:
            flat = torch.zeros(sum(self.numels), dtype=self.dtype, device=self.device)
            self.views = [flat[start:start + n] for start, n in zip(self.offsets, self.numels)]
        return self.views[index]


class FullBucket:
    """One flat group's full-size gradient bucket, alive only while a reduction needs it:
    allocated zeroed at the first gradient, handed over whole at launch (a group no
    gradient reached reduces zeros), and started afresh by the next gradient."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self._buffer: torch.Tensor | None = None

    @property
    def filling(self) -> bool:
        """A bucket is alive: a gradient arrived since the last `take`."""
        return self._buffer is not None

    def add(self, offset: int, grad: torch.Tensor) -> None:
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self._buffer[offset:offset + grad.numel()].add_(grad.reshape(-1))

    def fill(self, grads: list[torch.Tensor | None], numels: list[int]) -> None:
        """Every gradient of the group at once, in slot order (None: none came), in one copy:
        a stage-3 unit hands its gradients over when the last one is in (sharded_unit.py)."""
        like = next(g for g in grads if g is not None)
        parts = [like.new_zeros(n) if g is None else g.reshape(-1) for g, n in zip(grads, numels)]
        pad = self.numel - sum(numels)
        if pad:
            parts.append(like.new_zeros(pad))
        flat = torch.cat(parts).to(self.dtype)
        if self._buffer is None:
            self._buffer = flat
        else:
            self._buffer.add_(flat)

    def take(self) -> torch.Tensor:
        """The filled bucket; this object holds nothing until the next `add`."""
        buffer = self._buffer
        self._buffer = None
        if buffer is None:
            return torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return buffer


class ShardAccumulated:
    """Stage 2: only the reduced shard persists; full-size gradients live one bucket at a time."""

    reduces_every_microstep = True
    temporary_buckets = 1  # the full-size bucket, dropped once reduced
    scatters = True

    def __init__(self, group: FlatParamGroup, shards: ContiguousShards, index: int):
        self.group = group
        self.shards, self.index = shards, index
        self.dtype, self.device = shards.dtype, shards.device  # the bucket's (reduce-scatter's)
        self.bucket = FullBucket(group.padded_numel, self.dtype, self.device)

    @property
    def shard(self) -> torch.Tensor:
        return self.shards.shard(self.index)

    def accumulate(self, offset: int, grad: torch.Tensor) -> None:
        self.bucket.add(offset, grad)

    def fill(self, grads: list[torch.Tensor | None]) -> None:
        self.bucket.fill(grads, [slot.numel for slot in self.group.slots])

    def launch(self, comm: Reduction) -> Pending:
        bucket = self.bucket.take()
        comm.note_buffer(bucket)
        out = torch.empty(self.group.shard_numel, dtype=self.dtype, device=self.device)
        pending = comm.reduce_scatter(out, bucket, async_op=True)

        def add_into_shard() -> None:
            pending.wait()
            self.shard.add_(out)
            comm.release_buffer(bucket)

        return Pending(None, add_into_shard)

    def reduced(self) -> torch.Tensor:
        return self.shard

    def square(self) -> torch.Tensor:
        """The squared L2 norm of `reduced()` (fp32)."""
        return torch.linalg.vector_norm(self.reduced(), dtype=torch.float32) ** 2

    def zero(self) -> None:
        self.shard.zero_()

    def held(self) -> list[torch.Tensor]:
        return [self.shard]


@dataclass(frozen=True)
class StepSettings:
    """The config values the schedule reads (zero_optimization and the top level)."""

    overlap: bool = True  # overlap_comm: reductions run while backward goes on
    gradient_clipping: float = 0.0  # gradient_clipping: max global norm, 0 = off
    allgather_bucket_numel: int = 500_000_000  # allgather_bucket_size, in elements
    # full-size gradient buckets alive, filling or reducing (CB): a reduction waits for older
    # ones until it is within max_buckets - 1 in flight, and a bucket starts filling only when
    # fewer than max_buckets are in flight (1: one bucket at a time)
    max_buckets: int = BUCKETS_ALIVE


class ZeroOptimizer:
    """Reduces gradients during backward and runs the optimizer step's phases, in order.

    Built once by the engine from parts chosen at construction: the flat groups,
    the collectives (`plan`: which group reduces, which shards), where masters and
    parameter shards live (`masters`, `params`: offload/placement.py), the torch
    optimizer over the master shards, the loss scaler and the model-parallel norm.
    """

    def __init__(self, groups: list[FlatParamGroup], plan: CommPlan, masters: MastersPlacement,
                 params: ParamPlacement, optimizer: torch.optim.Optimizer,
                 scaler: NoScaler | StaticScaler | DynamicScaler, mp_norm: ModelParallelNorm,
                 settings: StepSettings):
        self.groups = groups
        self.plan = plan
        self.masters = masters
        self.params = params
        self.optimizer = optimizer
        self.scaler = scaler
        self.mp_norm = mp_norm
        self.settings = settings
        self.grad_norm: float | None = None  # pre-clip global norm of the last step
        self.in_flight: deque[Pending] = deque()
        # most full-size buckets alive at once (one starting + reductions not yet waited for):
        # the bound `max_buckets` keeps, observable (a reduction not waited for holds its buffers)
        self.buckets_alive_peak = 0
        self.reducing = False
        self.next_to_launch = 0
        self.ready = [False] * len(groups)  # this backward: every gradient of group i is in
        self.missing: list[int] = [len(g.params) for g in groups]  # `hook_parameters` counts
        self.gathered_callbacks: list[Callable[[], None]] = []
        self.hooks: list = []

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
            if self.launched(gi):
                name = next(s.name for s in group.slots if s.offset == offset)
                raise RuntimeError(f"parameter {name!r} received a second gradient in one backward "
                                   "after its bucket was reduced; use zeromem.checkpoint")
            if self.missing[gi] == len(group.params):  # a bucket starts
                self.bucket_starts()
            group.grads.accumulate(offset, param.grad)
            param.grad = None
            self.missing[gi] -= 1
            if self.missing[gi] == 0:
                self.group_ready(gi)
        return on_grad

    def bucket_starts(self) -> None:
        """A full-size bucket is about to fill: at most `max_buckets` are alive."""
        if self.reducing:
            self._wait_in_flight(self.settings.max_buckets - 1)
            self.buckets_alive_peak = max(self.buckets_alive_peak, len(self.in_flight) + 1)

    def group_ready(self, gi: int) -> None:
        """Every gradient of group `gi` is in its buffer: launch it once those before it are."""
        self.ready[gi] = True
        if self.reducing:
            self._launch_ready()

    def launched(self, gi: int) -> bool:
        """Was group `gi`'s reduction launched in this backward?"""
        return self.reducing and gi < self.next_to_launch

    def one_bucket_at_a_time(self) -> bool:
        """A single full-size bucket alive at once (reduced shards go to an NVMe file)."""
        return self.settings.max_buckets == 1

    def after_gather(self, callback: Callable[[], None]) -> None:
        """Call `callback()` each time the updated parameter shards were all-gathered."""
        self.gathered_callbacks.append(callback)

    def start_backward(self, boundary: bool) -> None:
        """Called before each backward; `boundary` marks the last micro-step of a step."""
        self.masters.start_backward(boundary)  # host copies of reduced grads at the boundary
        every_micro = bool(self.groups) and self.groups[0].grads.reduces_every_microstep
        self.reducing = boundary or every_micro
        self.next_to_launch = 0
        self.ready = [False] * len(self.groups)
        self.missing = [len(g.params) for g in self.groups]

    def _launch_ready(self) -> None:
        while self.next_to_launch < len(self.groups) and self.ready[self.next_to_launch]:
            self._launch(self.next_to_launch)

    def _wait_in_flight(self, most: int) -> None:
        """Wait for the oldest reductions until at most `most` are in flight."""
        while len(self.in_flight) > max(0, most):
            self.in_flight.popleft().wait()

    def _launch(self, gi: int) -> None:
        self._wait_in_flight(self.settings.max_buckets - 2)
        pending = self.groups[gi].grads.launch(self.plan.grads)
        self.next_to_launch = gi + 1
        if self.settings.overlap:
            self.in_flight.append(pending)
        else:
            pending.wait()

    def finish_backward(self) -> None:
        """Launch the buckets no hook completed (unused parameters), then wait for all."""
        if self.reducing:
            while self.next_to_launch < len(self.groups):
                self._launch(self.next_to_launch)
        while self.in_flight:
            self.in_flight.popleft().wait()
        self.reducing = False

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    # -- the step ------------------------------------------------------------------
    def step(self) -> bool:
        """Phases 1-5 (module docstring); True when fp16 overflow skipped the update."""
        norm = self._global_grad_norm()                          # 1. norm
        overflow = not math.isfinite(norm)
        self.grad_norm = norm
        if not overflow:                                         # 2. skip on overflow
            self._unscale_into_masters(norm)                     # 3. unscale
            self.optimizer.step()                                # 4. update
            for g in self.groups:
                g.master.grad = None
            self.gather_params()                                 # 5. gather
        self.scaler.update(overflow)
        return overflow

    def _global_grad_norm(self) -> float:
        """L2 norm of the averaged, unscaled gradient of the whole model (padding holds zeros)."""
        if not self.groups:
            return 0.0
        sq = torch.stack([self.mp_norm.square(g) for g in self.groups]).sum()
        if self.groups[0].shard_world > 1:
            self.plan.shard.all_reduce(sq, kind="all_reduce_norm")
        self.mp_norm.all_reduce(sq)
        return float(sq.sqrt()) / self.scaler.scale

    def _unscale_into_masters(self, norm: float) -> None:
        clip = self.settings.gradient_clipping
        coef = min(1.0, clip / (norm + 1e-6)) if clip and clip > 0 else 1.0
        self.masters.unscale_grads(self.groups, coef / self.scaler.scale)

    def gather_params(self) -> None:
        """Masters into the parameter shards (wherever they live), then all-gather them."""
        self.masters.write_back(self.groups, self.params)
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
        for g in self.groups:
            g.grads.zero()
            for p in g.params:
                p.grad = None

    def refresh_params(self) -> None:
        """After a checkpoint load: compute-dtype parameters from the masters, no stale gradients."""
        self.gather_params()
        self.zero_grad()
