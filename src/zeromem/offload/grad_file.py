"""Reduced gradient shards in a swap file (ZeRO-Infinity, arXiv 2104.07857, section 5).

With the optimizer on NVMe at stage 2 or 3, a rank's fp32 gradient shard is as
large as its parameter shard (4 bytes per element); kept in host memory it
would grow with the model. Here each flat group's reduced shard goes to the
file grads.swp as soon as its reduce-scatter finishes (one ALIGN-aligned record
per group), and the NVMe optimizer reads it back sub-group by sub-group beside
the optimizer states (offload/nvme_optimizer.py).

    ShardToFile (one per flat group; placement.build_grads picks it over flat.ShardAccumulated)
        accumulate(offset, grad)   into a full-size bucket, as ShardAccumulated
        launch(comm)               reduce-scatter; when done, `GradFile.put` the shard
        reduced()                  the shard read back
        square()                   its squared norm, taken at `put` (the global norm reads nothing)
        zero()                     the next `put` starts a fresh gradient
    GradFile
        put(group, shard)          write (or, accumulating, read + add + write)
        read(group) / read_piece   whole shard / an aligned range for the optimizer
        flush()                    every write finished (before the step reads)
        stored(group)              its record is this step's and written: a read may start
                                   (`on_put` tells the optimizer after each put, so its first
                                   sub-groups' gradient reads start in backward)
        take                       where the optimizer steps in the boundary backward
                                   (offload/backward_step.py), `put` hands it the shard
                                   first; a shard it took whole is not written (nor read back)

Buffer lifetimes: a bucket lives from the group's first gradient to the end of its
reduce-scatter (as at stage 2/3 without offload), but at most two buckets are alive
at a time (`MastersOnNvme.buckets_alive`: one reducing while the next group's
gradients fill the other; its launch waits for the reduction before it; more would
each hold a whole unit, gloo's receive buffer and a shard); a reduced shard lives
until its write completes, at most `MAX_WRITES` of them at once.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from zeromem.comm import Pending, Reduction
from zeromem.flat import FlatParamGroup, FullBucket, squared_norm
from zeromem.offload.nvme import (IOHandle, OffloadError, SwapSpace, aligned_empty, piece_bytes,
                                  piece_range, piece_view, round_up)

__all__ = ["GradFile", "ShardToFile", "piece_bytes", "piece_view", "record_bytes"]

# reduced shards waiting for their write: bounds host memory in backward (each is one
# unit's shard: with more, backward's peak grows with the units' size)
MAX_WRITES = 1


def record_bytes(numel: int) -> int:
    """Bytes of one flat group's record in grads.swp: its fp32 shard, ALIGN-aligned."""
    return round_up(numel * 4)


def aligned_fp32(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw aligned uint8 buffer rounded up to ALIGN, its first `numel` fp32 elements)."""
    raw = aligned_empty(round_up(max(1, numel) * 4))
    return raw, raw[:numel * 4].view(torch.float32)


class GradFile:
    """This rank's reduced gradient shards, one aligned fp32 record per flat group.

    `accum_dtype` (config.grad_dtype: data_types.grad_accum_dtype, else the compute dtype)
    is the dtype micro-steps accumulate in, as in the gradient buffer kept in memory
    (flat.ShardAccumulated) and as DeepSpeed does, whatever the placement: an fp32 record
    holding a bf16 sum rounds it to bf16 at each micro-step, so NVMe trains like CPU offload.
    """

    def __init__(self, groups: list[FlatParamGroup], space: SwapSpace,
                 accum_dtype: torch.dtype = torch.float32):
        self.accum_dtype = accum_dtype
        self.offsets: dict[int, int] = {}
        total = 0
        for g in groups:
            self.offsets[id(g)] = total
            total += record_bytes(g.shard_numel)
        self.file = space.file("grads.swp", total)
        self.numel = {id(g): g.shard_numel for g in groups}
        self.written: set[int] = set()  # groups whose record holds this step's gradient
        # the squared norm of each written record, taken while the shard was in memory: the
        # step's global norm then reads nothing (a whole extra pass over grads.swp, waited for)
        self.squares: dict[int, torch.Tensor] = {}
        self.writing: deque[tuple[int, torch.Tensor, IOHandle]] = deque()  # (group id, ...)
        # called after each `put` (the NVMe optimizer starts reads of stored gradients)
        self.on_put: Callable[[FlatParamGroup], None] | None = None
        # given each shard `put` first (the NVMe optimizer's step in backward); True: taken
        # whole, so not written: the group's record is then not this step's (`consumed`)
        self.take: Callable[[FlatParamGroup, torch.Tensor], bool] | None = None
        self.consumed: set[int] = set()
        self.bytes_written = 0
        self.bytes_read = 0
        self.failed: BaseException | None = None  # a lost write: no later gradient is whole

    def put(self, group: FlatParamGroup, raw: torch.Tensor, shard: torch.Tensor) -> None:
        """Store `shard` (a view of the aligned `raw`) as the group's gradient, or add it."""
        self._check()
        key = id(group)
        if key in self.written:  # accumulating over micro-steps: record += shard
            shard.add_(self.read(group))
            if self.accum_dtype != torch.float32:  # the sum rounded as accum_dtype's add rounds
                shard.copy_(shard.to(self.accum_dtype))
        self.squares[key] = squared_norm(shard)
        if self.take is not None and self.take(group, shard):
            self.written.discard(key)  # the record holds earlier micro-steps' sum only
            self.consumed.add(key)
            return
        self.written.add(key)
        self.writing.append((key, raw, self.file.write(raw, self.offsets[key])))
        self.bytes_written += raw.numel()
        while len(self.writing) > MAX_WRITES:
            self._wait_oldest()
        if self.on_put is not None:
            self.on_put(group)

    def stored(self, group: FlatParamGroup) -> bool:
        """The group's record holds this step's gradient, its write finished (a read may start)."""
        key = id(group)
        return key in self.written and all(k != key for k, _, _ in self.writing)

    def read(self, group: FlatParamGroup) -> torch.Tensor:
        """The group's gradient shard (zeros when none was stored this step), in fresh memory."""
        key = id(group)
        self._check_kept(key)
        raw, shard = aligned_fp32(self.numel[key])
        if key not in self.written:
            return shard.zero_()
        self.flush()
        self.file.read(raw, self.offsets[key]).wait()
        self.bytes_read += raw.numel()
        return shard

    def square(self, group: FlatParamGroup) -> torch.Tensor:
        """The squared L2 norm of the group's gradient shard (0 when none was stored)."""
        return self.squares.get(id(group), torch.zeros(()))  # `zero` drops it

    def read_piece(self, group: FlatParamGroup, start: int, numel: int,
                   buf: torch.Tensor) -> tuple[torch.Tensor, IOHandle | None]:
        """Start reading elements [start, start + numel) into the aligned uint8 `buf`.

        Returns the fp32 view of those elements in `buf` (which must hold
        `piece_bytes(numel)`) and the read's handle (None: no gradient, zeros).
        """
        begin, length = piece_range(start, numel)
        view = piece_view(start, numel, buf)
        self._check_kept(id(group))
        if id(group) not in self.written:
            view.zero_()
            return view, None
        self.bytes_read += length
        return view, self.file.read(buf[:length], self.offsets[id(group)] + begin)

    def flush(self) -> None:
        """Wait for every write in flight."""
        self._check()
        while self.writing:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        try:
            self.writing.popleft()[2].wait()
        except BaseException as e:
            self.failed = e
            raise

    def _check_kept(self, key: int) -> None:
        if key in self.consumed:
            raise OffloadError("this gradient shard was stepped in the boundary backward and not "
                               "kept (offload/backward_step.py)")

    def _check(self) -> None:
        if self.failed is not None:
            raise OffloadError(f"NVMe offload failed earlier and the gradients in "
                               f"{self.file.path} are not whole: {self.failed}")

    def zero(self, group: FlatParamGroup) -> None:
        self.written.discard(id(group))
        self.consumed.discard(id(group))
        self.squares.pop(id(group), None)


class ShardToFile:
    """Stage 2/3 gradients of one flat group, reduced shard stored in the `GradFile`."""

    reduces_every_microstep = True
    temporary_buckets = 1  # the full-size bucket, dropped once its shard is stored
    scatters = True

    def __init__(self, group: FlatParamGroup, dtype: torch.dtype, device: torch.device,
                 store: GradFile):
        self.group = group
        self.dtype = dtype  # the bucket's (reduce-scatter's) dtype; the file holds fp32
        self.device = device
        self.store = store
        self.bucket = FullBucket(group.padded_numel, dtype, device)

    def accumulate(self, offset: int, grad: torch.Tensor) -> None:
        self.bucket.add(offset, grad)

    def fill(self, grads: list[torch.Tensor | None]) -> None:
        self.bucket.fill(grads, [slot.numel for slot in self.group.slots])

    def launch(self, comm: Reduction) -> Pending:
        g = self.group
        bucket = self.bucket.take()
        comm.note_buffer(bucket)
        raw, shard = aligned_fp32(g.shard_numel)
        direct = self.dtype == torch.float32 and self.device.type == "cpu"
        out = shard if direct else torch.empty(g.shard_numel, dtype=self.dtype,
                                               device=self.device)
        pending = comm.reduce_scatter(out, bucket, async_op=True)

        def store() -> None:
            pending.wait()
            if out is not shard:
                shard.copy_(out)
            comm.release_buffer(bucket)
            self.store.put(g, raw, shard)

        return Pending(None, store)

    def reduced(self) -> torch.Tensor:
        return self.store.read(self.group).to(self.device)

    def square(self) -> torch.Tensor:
        """Kept by `GradFile.put`: the norm reads no gradient back."""
        return self.store.square(self.group).to(self.device)  # the norm's collective runs there

    def zero(self) -> None:
        self.store.zero(self.group)

    def held(self) -> list[torch.Tensor]:
        return []  # in the file; the ledger files its bytes under grads / nvme
