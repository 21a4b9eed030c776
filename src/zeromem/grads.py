"""Gradient buffers and the bucketed reducer that overlaps reduction with backward.

Each flat group is one bucket. A post-accumulate-grad hook on every parameter adds
its gradient into the group's buffer and frees `param.grad` at once, so the
full-size gradient of a parameter lives only for the moment autograd produced it.
When every parameter of a bucket has reported, the bucket's collective is
launched asynchronously while backward goes on.

Ranks must issue collectives in the same order even when their graphs differ
(a parameter unused on one rank only), so buckets launch strictly in index order:
a ready bucket waits for the ones before it, and `finish_backward()` launches
whatever is left (a bucket no gradient reached reduces zeros) and waits. At most
`max_buckets` full-size buckets are alive, filling or reducing (BUCKETS_ALIVE by
default; 1 when reduced shards go to an NVMe file, offload/grad_file.py, so that
backward's host memory is one unit's gradient path).

Three buffer kinds, chosen once from `Sharding` (llm.c style: data, not branches):

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

from collections import deque
from typing import Callable, Protocol

import torch
from torch import nn

from zeromem.comm import Comm, Pending, Reduction, reduce_scatter_copies
from zeromem.flat import FlatParamGroup
from zeromem.layout import REDUCE_IN_FLIGHT

# full-size buckets alive at once by default: REDUCE_IN_FLIGHT reducing (one finishing while
# the next overlaps backward) and one filling. Each reducing one also holds gloo's receive buffer.
BUCKETS_ALIVE = REDUCE_IN_FLIGHT + 1


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


class ShardAccumulated:
    """Stage 2: only the reduced shard persists; full-size gradients live one bucket at a time."""

    reduces_every_microstep = True
    temporary_buckets = 1  # the full-size bucket, dropped once reduced
    scatters = True

    def __init__(self, group: FlatParamGroup, shards: ContiguousShards, index: int):
        self.group = group
        self.shards, self.index = shards, index
        self.dtype, self.device = shards.dtype, shards.device  # the bucket's (reduce-scatter's)
        self.bucket: torch.Tensor | None = None

    @property
    def shard(self) -> torch.Tensor:
        return self.shards.shard(self.index)

    def accumulate(self, offset: int, grad: torch.Tensor) -> None:
        if self.bucket is None:
            self.bucket = torch.zeros(self.group.padded_numel, dtype=self.dtype,
                                      device=self.device)
        self.bucket[offset:offset + grad.numel()].add_(grad.reshape(-1))

    def launch(self, comm: Reduction) -> Pending:
        bucket = self.bucket if self.bucket is not None else torch.zeros(
            self.group.padded_numel, dtype=self.dtype, device=self.device)
        self.bucket = None
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

    def zero(self) -> None:
        self.shard.zero_()

    def held(self) -> list[torch.Tensor]:
        return [self.shard]


class Reducer:
    """Hooks parameters, tracks bucket readiness and launches reductions in bucket order."""

    def __init__(self, groups: list[FlatParamGroup], comm: Comm | Reduction, overlap: bool,
                 max_buckets: int = BUCKETS_ALIVE):
        self.groups = groups
        self.comm = comm
        self.overlap = overlap
        # full-size buckets alive, filling or reducing: a reduction waits for older ones until
        # it is within max_buckets - 1 in flight, and a bucket starts filling only when fewer
        # than max_buckets are in flight (1: one bucket at a time)
        self.max_buckets = max_buckets
        self.in_flight: deque[Pending] = deque()
        self.reducing = False
        self.next_to_launch = 0
        self.missing: list[int] = [len(g.params) for g in groups]
        # Told when a group's last gradient was accumulated this backward (stage 3 releases
        # the unit then): readiness is counted here only, so nothing can act on a group
        # before its gradients are in the bucket, whatever order hooks were registered in.
        self.ready_callbacks: list[Callable[[FlatParamGroup], None]] = []
        self.hooks = []
        for gi, g in enumerate(groups):
            for p, slot in zip(g.params, g.slots):
                self.hooks.append(p.register_post_accumulate_grad_hook(self._hook(gi, slot.offset)))

    def _hook(self, gi: int, offset: int):
        def on_grad(param: nn.Parameter) -> None:
            group = self.groups[gi]
            if self.reducing and gi < self.next_to_launch:
                name = next(s.name for s in group.slots if s.offset == offset)
                raise RuntimeError(f"parameter {name!r} received a second gradient in one backward "
                                   "after its bucket was reduced; use zeromem.checkpoint")
            if self.reducing and self.missing[gi] == len(group.params):  # a bucket starts
                self._wait_in_flight(self.max_buckets - 1)
            group.grads.accumulate(offset, param.grad)
            param.grad = None
            self.missing[gi] -= 1
            if self.missing[gi] == 0:
                if self.reducing:
                    self._launch_ready()
                for callback in self.ready_callbacks:
                    callback(group)
        return on_grad

    def on_grads_ready(self, callback: Callable[[FlatParamGroup], None]) -> None:
        """Call `callback(group)` once per backward, when the group's gradients are all in."""
        self.ready_callbacks.append(callback)

    def start_backward(self, boundary: bool) -> None:
        """Called before each backward; `boundary` marks the last micro-step of a step."""
        every_micro = bool(self.groups) and self.groups[0].grads.reduces_every_microstep
        self.reducing = boundary or every_micro
        self.next_to_launch = 0
        self.missing = [len(g.params) for g in self.groups]

    def _launch_ready(self) -> None:
        while self.next_to_launch < len(self.groups) and self.missing[self.next_to_launch] <= 0:
            self._launch(self.next_to_launch)

    def _wait_in_flight(self, most: int) -> None:
        """Wait for the oldest reductions until at most `most` are in flight."""
        while len(self.in_flight) > max(0, most):
            self.in_flight.popleft().wait()

    def _launch(self, gi: int) -> None:
        self._wait_in_flight(self.max_buckets - 2)
        pending = self.groups[gi].grads.launch(self.comm)
        self.next_to_launch = gi + 1
        if self.overlap:
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
