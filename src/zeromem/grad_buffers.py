"""A flat group's gradient buffer: where its gradient accumulates over micro-steps, how it
is reduced, and where the reduced gradient is read (flat.py's `FlatParamGroup` owns one,
chosen once, and is the only way in).

Three gradient buffer kinds, chosen once from `Sharding` (llm.c style: data, not branches):

- `WholeAllReduced`  (stage 0): whole buffer, all-reduced at the boundary.
- `WholeScattered`   (stage 1): whole buffer, reduce-scattered at the boundary;
  the owned chunk of the whole buffer is the reduced shard.
- `ShardAccumulated` (stages 2, 3): only the shard persists, as a view into one
  contiguous buffer shared by all groups (`contiguous_gradients`); a temporary
  full bucket (`FullBucket`) is filled during each micro-step's backward,
  reduce-scattered, added into the shard and dropped.

The kind is a private part of its group: the group's gradient transitions (`add_grad`,
`fill_grads`, `launch_reduction`, `reduced_grad`, `grad_square`, `zero_grad`) are the
only way in. Whoever sees the gradients come (the ZeRO optimizer's hooks at stages 0-2,
the stage-3 unit) fills the group and hands its `launch_reduction` to the shard group's
`Comm`, which launches them in order (`Comm.reduce_in_order`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch

from zeromem.comm import AllReduction, Pending, Reduction, reduce_scatter_copies

if TYPE_CHECKING:
    from zeromem.flat import FlatParamGroup


def dense(grad: torch.Tensor) -> torch.Tensor:
    """`nn.Embedding(sparse=True)` gives a sparse gradient; the buckets are dense, and so is
    its reduction (DeepSpeed's `sparse_gradients` all-gathers the rows instead)."""
    return grad.to_dense() if grad.is_sparse else grad


class HostCopies(Protocol):
    """Offload's fp32 host buffers for reduced gradients (offload/masters.py `HostGrads`),
    given to each gradient buffer when it is built (FSDP2's OffloadPolicy): the buffer then
    knows that its reduced shard goes there after each boundary reduction."""

    boundary: bool  # the backward now running ends a step

    def buffer_for(self, group: FlatParamGroup, reduced: torch.Tensor) -> torch.Tensor | None:
        """`group`'s host buffer; None where `reduced` already is one (fp32 in host memory)."""


def copied_to_host(pending: Pending, host: HostCopies | None, buffer: torch.Tensor | None,
                   reduced: Callable[[], torch.Tensor]) -> Pending:
    """`pending`, then (offload, boundary) the reduced shard copied into its host buffer,
    non-blocking: the copy overlaps the rest of backward (the step syncs before reading)."""
    if host is None or buffer is None:
        return pending  # the reduced shard stays where it is reduced, or already is on host
    if not host.boundary:
        return pending  # stage 2 accumulates on the device until the last micro-step

    def copy_to_host() -> None:
        pending.wait()
        buffer.copy_(reduced(), non_blocking=True)

    return Pending(None, copy_to_host)


class GradKind(Protocol):
    """What sizes a gradient kind's communication buffers (class attributes)."""

    temporary_buckets: int
    scatters: bool


class GradBuffer(GradKind, Protocol):
    """A gradient kind's instance: the part of one group that holds and reduces its gradient."""

    reduces_every_microstep: bool

    def accumulate(self, offset: int, grad: torch.Tensor) -> None: ...
    def fill(self, grads: list[torch.Tensor | None]) -> None: ...
    def launch(self, comm: Reduction) -> Pending: ...
    def reduced(self) -> torch.Tensor: ...
    def square(self) -> torch.Tensor: ...
    def zero(self) -> None: ...
    def held(self) -> list[torch.Tensor]: ...


def launch_copies(kind: GradKind, backend: str) -> int:
    """Full-size buffers (each as large as the group's bucket) that one launch of a group of
    gradient `kind` holds until it is waited on, all noted in Comm's CB figure: the bucket
    itself when it is a temporary, and the backend's receive buffer when it is
    reduce-scattered (`comm.reduce_scatter_copies`). The planner sizes CB with this."""
    return kind.temporary_buckets + (reduce_scatter_copies(backend) if kind.scatters else 0)


class WholeAllReduced:
    """Stage 0: every rank keeps the whole summed gradient.

    The whole buffer is reduced in place, once a step at the boundary backward. A
    second backward before the step (a GAN's discriminator takes two) must not reduce
    the first one's sum again: the sum is set aside, the buffer zeroed for the new
    gradients, and the sum added back once they are reduced (`_reduced_before`)."""

    reduces_every_microstep = False
    temporary_buckets = 0  # full-size buffers a launch holds besides the collective's own
    scatters = False  # all-reduced in place: no receive buffer

    def __init__(self, group: FlatParamGroup, dtype: torch.dtype, host: HostCopies | None = None):
        self.group = group
        self.whole = torch.zeros(group.padded_numel, dtype=dtype, device=group.param_shard.device)
        self.host = host  # offload: where the reduced shard is copied at the boundary
        self.host_buffer = host.buffer_for(group, self.reduced()) if host is not None else None
        self.launched = False  # reduced since the last `zero`: a new gradient sets it aside
        self.earlier: torch.Tensor | None = None  # set aside, added back after the reduction

    def accumulate(self, offset: int, grad: torch.Tensor) -> None:
        if self.launched:
            self._set_aside()
        self.whole[offset:offset + grad.numel()].add_(grad.reshape(-1))

    def fill(self, grads: list[torch.Tensor | None]) -> None:
        for slot, grad in zip(self.group.slots, grads):
            if grad is not None:
                self.accumulate(slot.offset, grad)

    def _set_aside(self) -> None:
        self.earlier = self.reduced().clone()
        self.whole.zero_()  # the other ranks' parts too (stage 1): they were reduced
        self.launched = False

    def launch(self, comm: Reduction) -> Pending:
        if not isinstance(comm, AllReduction):
            raise TypeError(f"stage 0 all-reduces its gradient; {type(comm).__name__} cannot")
        return self._reduced_before(comm.all_reduce(self.whole, async_op=True))

    def _reduced_before(self, pending: Pending) -> Pending:
        """`pending`, then what earlier backwards of this step reduced added back, then the
        host copy (offload)."""
        self.launched = True
        earlier, self.earlier = self.earlier, None
        if earlier is not None:
            reduction = pending

            def add_back() -> None:
                reduction.wait()
                self.reduced().add_(earlier)

            pending = Pending(None, add_back)
        return copied_to_host(pending, self.host, self.host_buffer, self.reduced)

    def reduced(self) -> torch.Tensor:
        return self.whole

    def square(self) -> torch.Tensor:
        """The squared L2 norm of `reduced()` (fp32)."""
        return torch.linalg.vector_norm(self.reduced(), dtype=torch.float32) ** 2

    def zero(self) -> None:
        self.whole.zero_()
        self.launched = False

    def held(self) -> list[torch.Tensor]:
        return [self.whole]


class WholeScattered(WholeAllReduced):
    """Stage 1: the whole gradient accumulates locally; the boundary reduce-scatters it."""

    scatters = True

    def launch(self, comm: Reduction) -> Pending:
        return self._reduced_before(comm.reduce_scatter(self.reduced(), self.whole, async_op=True))

    def reduced(self) -> torch.Tensor:
        g = self.group
        return self.whole[g.shard_offset:g.shard_offset + g.shard_numel]


class ContiguousShards:
    """`contiguous_gradients`: every group's reduced shard is a view into one zeroed buffer.

    The buffer is allocated when a shard is first read, not at construction: where reduced
    shards go to a swap file instead (offload/grad_file.py `ShardToFile`, chosen when the
    gradient buffers are built), none is ever read, and no rank holds the model's gradient
    shard.
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
        a stage-3 unit fills its bucket when the last one is in (stage3/sharded_unit.py)."""
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

    def __init__(self, group: FlatParamGroup, shards: ContiguousShards, index: int,
                 host: HostCopies | None = None):
        self.group = group
        self.shards, self.index = shards, index
        self.dtype, self.device = shards.dtype, shards.device  # the bucket's (reduce-scatter's)
        self.bucket = FullBucket(group.padded_numel, self.dtype, self.device)
        self.host = host  # offload: where the reduced shard is copied at the boundary
        self.host_buffer = host.buffer_for(group, self.shard) if host is not None else None

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

        return copied_to_host(Pending(None, add_into_shard), self.host, self.host_buffer,
                              self.reduced)

    def reduced(self) -> torch.Tensor:
        return self.shard

    def square(self) -> torch.Tensor:
        """The squared L2 norm of `reduced()` (fp32)."""
        return torch.linalg.vector_norm(self.reduced(), dtype=torch.float32) ** 2

    def zero(self) -> None:
        self.shard.zero_()

    def held(self) -> list[torch.Tensor]:
        return [self.shard]
