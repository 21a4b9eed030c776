"""Stage-3 parameter shards on NVMe (`offload_param.device: nvme`, ZeRO-Infinity).

The third `ParamPlacement` (offload/params.py has the protocol and the two in memory).

Buffer lifetimes: shards in the file params.swp (offsets aligned by `round_up`)
and a pool of `offload_param.buffer_count` buffers (`ShardBuffers`). Shard i is
always read into buffer i % count, which is the size of the largest shard it
serves: every byte of the pool is filled by some shard each pass, so the pool
holds no memory a pass cannot use (buffers all the size of the largest shard
were filled only in part by the smaller shards), and its size is a pure
function of the shard sizes that the planner computes too (`pool_nbytes`).
A shard is read when its unit is unsharded (and the shards of the next units
in the followed order are read ahead: they are consecutive in admit order, so
in other buffers); `group.param_shard` is then a view into its buffer. It
stays until another shard needs that buffer (after the all-gather in flight
from it, if any) or until released, and is written back only if the
optimizer changed it; the buffer is free again when that write completes.
Inside `all_in_memory()` each shard has its own memory, written back to the
file after the block.

The NVMe optimizer's fp32 step (where the master is the shard) reads and writes
its pieces of params.swp straight from its own buffers (`read_piece` /
`write_piece`; with two copies a 16-bit step writes its new values so too), so the
step holds no pool buffer and waits on no eviction; the
writes are left in flight and waited for before that record is next read or
written (`piece_writes`). A block that two pieces of a shard share (sub-groups
cut shards anywhere) is written once, by the piece stepped last, which takes the
other pieces' bytes of it from `boundary` (pieces may be stepped in any order).

Two copies (`copies=2`, when the optimizer may step in the boundary backward: fp32
or bf16, offload/nvme_optimizer.py): params.swp holds every record twice; reads use
the current copy, the optimizer's piece writes go to the other one, and `commit` (the
step was taken) makes that one current. Until then every read, a re-gather in the
same backward too, sees the shards as they were, and a skipped step (`discard`)
leaves them as they were.
"""
from __future__ import annotations

import contextlib
from collections import deque
from itertools import accumulate
from typing import Any, Iterator, Sequence

import torch

from zeromem.config.schema import OffloadParamConfig
from zeromem.flat import FlatParamGroup
from zeromem.offload.nvme import (ALIGN, IOHandle, OffloadError, SwapSpace, aligned_empty,
                                  aligned_nbytes, piece_range, piece_view, round_up)
from zeromem.offload.params import Reader

__all__ = ["ParamsOnNvme", "ShardBuffers"]


class ShardBuffers:
    """The parameter pool: one arena cut into `count` buffers, shard i's always buffer i % count.

    `count` is `buffer_count`, but never more than there are shards. Each buffer is
    the largest of its shards (ALIGN-rounded, as their reads ask), so every byte is
    filled by one of them each pass: what is allocated is what a pass uses.
    """

    def __init__(self, shard_bytes: Sequence[int], buffer_count: int, pin_memory: bool):
        sizes = self.buffer_sizes(shard_bytes, buffer_count)
        self.arena = aligned_empty(sum(sizes), pin_memory)
        self.buffers = [self.arena[at:at + n] for at, n in zip(accumulate(sizes, initial=0), sizes)]
        self.free = set(range(len(sizes)))

    @staticmethod
    def buffer_sizes(shard_bytes: Sequence[int], buffer_count: int) -> list[int]:
        """Bytes of each buffer for shards of `shard_bytes` (in admit order)."""
        sizes = [ALIGN] * max(1, min(buffer_count, len(shard_bytes)))
        for i, nbytes in enumerate(shard_bytes):
            sizes[i % len(sizes)] = max(sizes[i % len(sizes)], round_up(nbytes))
        return sizes

    @classmethod
    def pool_nbytes(cls, shard_bytes: Sequence[int], buffer_count: int) -> int:
        """Host bytes the pool holds for shards of `shard_bytes` (what `nbytes` reports)."""
        return aligned_nbytes(sum(cls.buffer_sizes(shard_bytes, buffer_count)))

    @property
    def count(self) -> int:
        return len(self.buffers)

    @property
    def widest(self) -> int:
        """The largest buffer: any shard fits it."""
        return max(range(self.count), key=lambda slot: self.buffers[slot].numel())

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds (the arena, alignment slack included)."""
        return self.arena.untyped_storage().nbytes()

    def slot(self, index: int) -> int:
        """The buffer of the shard admitted `index`-th."""
        return index % self.count

    def acquire(self, slot: int) -> torch.Tensor | None:
        """Buffer `slot`, or None while it is lent out."""
        if slot not in self.free:
            return None
        self.free.remove(slot)
        return self.buffers[slot]

    def release(self, slot: int) -> None:
        self.free.add(slot)


class ParamsOnNvme:
    """`offload_param.device: nvme` (stage 3): shards in a file, a bounded pool in memory."""

    where = "nvme"

    def __init__(self, shards: Sequence[tuple[int, torch.dtype]], device: torch.device,
                 space: SwapSpace, config: OffloadParamConfig, pin: bool, copies: int = 1):
        """params.swp laid out for `shards` of (elements, dtype), in `admit` order, each
        record `copies` times (2: the step writes the other copy, module docstring)."""
        self.groups: list[FlatParamGroup] = []
        self.frozen: set[int] = set()  # groups of frozen parameters (stage 3): never stepped
        self.host_is_device = device.type == "cpu"
        self.largest_unit_numel = 0  # the largest group admitted (whole, padded)
        self.dtypes = [dtype for _, dtype in shards]  # in admit order
        self.planned = [n * dtype.itemsize for n, dtype in shards]  # bytes, in admit order
        self.planned_offsets, total = [], 0
        for nbytes in self.planned:
            self.planned_offsets.append(total)
            total += round_up(nbytes)
        biggest = max((n for n, _ in shards), default=0)
        if biggest > config.buffer_size:
            raise OffloadError(f"a parameter shard of {biggest} elements exceeds "
                               "zero_optimization.offload_param.buffer_size = "
                               f"{config.buffer_size}")
        self.nbytes: dict[int, int] = {}  # group id -> bytes of its shard
        self.offsets: dict[int, int] = {}  # group id -> its record in params.swp
        self.slots: dict[int, int] = {}  # group id -> its buffer in the pool
        self.pool = ShardBuffers(self.planned, config.buffer_count, pin)
        self.copies, self.copy, self.stride = copies, 0, total  # the current copy at copy x stride
        self.file = space.file("params.swp", total * copies)
        self.lookahead = max(1, config.buffer_count // 2)
        self.in_memory: dict[int, tuple[FlatParamGroup, torch.Tensor]] = {}
        self.reading: dict[int, tuple[FlatParamGroup, torch.Tensor, IOHandle]] = {}
        self.writing: deque[tuple[int, IOHandle]] = deque()  # (slot, its write-back)
        self.dirty: set[int] = set()
        self.readers: dict[int, Reader] = {}
        # the optimizer's piece writes in flight, per group id, with their file ranges: waited
        # before that range is next read (the read would miss them) or the record written
        # whole (two writes land in either order); a step's pieces never overlap each other
        self.piece_writes: dict[int, list[tuple[int, int, IOHandle]]] = {}
        # (group id, block offset) -> (that block, bytes of it the pieces stepped so far gave)
        self.boundary: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self._order_now: Sequence[Any] | None = None  # what `follow` was told last
        self._order: Sequence[Any] | None = None  # the order indexed below
        self._position: dict[int, int] = {}  # group id -> position in `_order`
        # how fetch found its shard: already in memory, read ahead, or read on demand
        self.counts = {"in_memory": 0, "read_ahead": 0, "on_demand": 0}

    def admit(self, group: FlatParamGroup) -> None:
        """Write the new group's shard to its record now and drop it: the file is the truth."""
        index = len(self.groups)
        nbytes = group.shard_numel * group.param_shard.element_size()
        if index >= len(self.planned) or nbytes != self.planned[index] \
                or group.param_shard.dtype != self.dtypes[index]:
            raise AssertionError(f"{self.file.path}: group {index} of {nbytes} bytes "
                                 f"({group.param_shard.dtype}) was not laid out")
        self.groups.append(group)
        if not group.trains:
            self.frozen.add(id(group))
        self.nbytes[id(group)] = nbytes
        self.offsets[id(group)] = self.planned_offsets[index]
        self.slots[id(group)] = self.pool.slot(index)
        self.largest_unit_numel = max(self.largest_unit_numel, group.padded_numel)
        # through one buffer, the widest: initialize fills no more of the pool than that
        self._write_now(group, group.param_shard, self.pool.widest)
        group.drop_shard_storage()

    def _write_now(self, g: FlatParamGroup, shard: torch.Tensor, slot: int | None = None) -> None:
        """Write `shard` to g's record through buffer `slot` (g's own by default) and wait."""
        slot = self.slots[id(g)] if slot is None else slot
        self._settle_pieces(id(g))
        buf = self._acquire(slot)
        try:
            self._view(g, buf).copy_(shard)
            self.file.write(buf[:round_up(self.nbytes[id(g)])], self._at(id(g))).wait()
        finally:
            self.pool.release(slot)

    def _view(self, g: FlatParamGroup, buf: torch.Tensor) -> torch.Tensor:
        return buf[:self.nbytes[id(g)]].view(g.param_shard.dtype)

    # -- the interface ----------------------------------------------------------
    def fetch(self, group: FlatParamGroup, reader: Reader | None = None) -> None:
        """Bring the shard into a pool buffer (waiting for a read-ahead), then read ahead."""
        if reader is not None:
            self.readers[id(group)] = reader
        self._fetch(group)
        self._read_ahead(group)  # never evicts `group`: its all-gather has not started yet

    def release(self, group: FlatParamGroup) -> None:
        """Evict the shard (written back first when the optimizer changed it)."""
        if id(group) in self.in_memory:
            self._evict(id(group))

    def follow(self, order: Sequence[Any] | None) -> None:
        """Read ahead along `order` (fetch units, recorded by the stage-3 runner) from now on."""
        self._order_now = order

    def prefetch_numel(self, configured: int, set_in_config: bool) -> int:
        """On a CPU device, one unit gathered ahead (its gather overlaps this unit's compute;
        the shards of the units after it are read ahead into the pool meanwhile).

        There the gathered units are host memory: DeepSpeed's default window (5e7
        elements) would hold as much of the model gathered as fits in it, i.e. host
        memory growing with the model, which NVMe offload exists to avoid. A value the
        config sets is kept; on a GPU the gathered units are device memory.
        """
        if set_in_config or not self.host_is_device:
            return configured
        return min(configured, self.largest_unit_numel)

    def prefetch(self, group: FlatParamGroup, keep: int | None = None) -> None:
        key = id(group)
        if key in self.in_memory or key in self.reading:
            return
        self._reclaim(block=False)
        buf = self.pool.acquire(self.slots[key])
        if buf is None:  # its buffer holds another shard: dropped if clean and not in use
            holder = self._holder(self.slots[key])
            if holder is None or holder not in self.in_memory \
                    or not self._idle(holder, clean=True, keep=keep):
                return  # a read-ahead or write-back of it in flight, or a shard still needed
            self._evict(holder)
            buf = self.pool.acquire(self.slots[key])
            assert buf is not None  # the eviction freed it
        self._launch_read(group, buf)

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        self._fetch(group)
        out.copy_(group.param_shard[start:start + out.numel()])

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        self._fetch(group)
        group.param_shard[start:start + values.numel()].copy_(values)
        self.dirty.add(id(group))

    def read_piece(self, group: FlatParamGroup, start: int, numel: int, buf: torch.Tensor,
                   after: Sequence[IOHandle] = ()) -> IOHandle | None:
        """From the shard in memory if it is there (no I/O), else from params.swp; once the
        writes `after` (still reading from `buf`) have finished. With those still running,
        from params.swp, whose current copy the shard in memory is (two copies: nothing
        stores into it), so that the read waits for them in the I/O threads, not here."""
        key = id(group)
        begin, length = piece_range(start, numel)
        if key in self.in_memory and (self.copies == 1 or all(h.done() for h in after)):
            for h in after:
                h.wait()
            buf[:length].copy_(self.in_memory[key][1][begin:begin + length])
            return None
        self._settle_pieces(key, begin, begin + length)
        return self.file.read(buf[:length], self._at(key) + begin, after)

    def write_piece(self, group: FlatParamGroup, start: int, numel: int,
                    buf: torch.Tensor) -> list[IOHandle]:
        """Write the piece's blocks from `buf` (in the shard's dtype; two copies: to the other
        copy); a block another piece shares is written by the last of them to be stepped,
        with all their bytes (`_share`)."""
        key, size = id(group), group.param_shard.element_size()
        if self.copies == 1:
            if key in self.in_memory:  # the copy in memory stays current: the next forward uses it
                group.param_shard[start:start + numel].copy_(
                    piece_view(start, numel, buf, group.param_shard.dtype))
            self._forget_read(key)  # a read in flight would bring the old values
        begin, length = piece_range(start, numel, size)
        end, stop = begin + length, (start + numel) * size
        first, last = begin, end - ALIGN  # the first and last blocks (the same for a small piece)
        if start * size > begin or (stop % ALIGN and stop < self.nbytes[key] and last == first):
            if not self._share(key, first, buf[:ALIGN], start * size, stop):
                begin += ALIGN
        if last > first and stop % ALIGN and stop < self.nbytes[key]:
            if not self._share(key, last, buf[last - first:length], start * size, stop):
                end -= ALIGN
        if end <= begin:
            return []
        at = self._at(key, self.copies - 1)  # two copies: the one not current
        handle = self.file.write(buf[begin - first:end - first], at + begin)
        self.piece_writes.setdefault(key, []).append((at + begin, at + end, handle))
        return [handle]

    def _share(self, key: int, block: int, data: torch.Tensor, lo: int, hi: int) -> bool:
        """A block of `key`'s record that other pieces share: put this piece's bytes of it
        ([lo, hi) of the shard) in `boundary`; True when all its bytes are in, the block
        then in `data` (to be written now)."""
        own = slice(max(lo, block) - block, min(hi, block + ALIGN) - block)
        held, have = self.boundary.pop((key, block), (None, 0))
        if held is None:
            held = data.clone()
        else:
            held[own] = data[own]
        have += own.stop - own.start
        if have < min(ALIGN, self.nbytes[key] - block):
            self.boundary[(key, block)] = (held, have)
            return False
        data.copy_(held)
        return True

    def commit(self) -> None:
        """Two copies: the step was taken, the copy its pieces were written to is the shards
        now; shards read from the other one (in memory, or still reading) are dropped."""
        if self.copies == 1:
            return
        if self.boundary:
            raise OffloadError(f"{self.file.path}: the step left {len(self.boundary)} shared "
                               "blocks unwritten")
        self.copy = 1 - self.copy
        for key in list(self.reading):
            self._forget_read(key)
        for key in list(self.in_memory):
            reader = self.readers.get(key)
            if reader is not None and reader.pending is not None:
                reader.wait()
            self._evict(key)

    def discard(self) -> None:
        """The step was skipped: the copy being written is left as it is (the next step
        writes it whole again); the blocks waiting for their other pieces are dropped."""
        self.boundary.clear()

    def _at(self, key: int, other: int = 0) -> int:
        """File offset of `key`'s record in the current copy (`other`=1: the other copy); a
        frozen group, which no step writes, keeps its record in the first copy."""
        if key in self.frozen:
            return self.offsets[key]
        return self.offsets[key] + ((self.copy + other) % self.copies) * self.stride

    def flush(self) -> None:
        """Write every changed shard back and wait; the shards stay in memory, clean."""
        handles = []
        for key in self.dirty:
            g, buf = self.in_memory[key]
            self._settle_pieces(key)
            handles.append(self.file.write(buf[:round_up(self.nbytes[key])], self._at(key)))
        self.dirty.clear()
        for h in handles:
            h.wait()
        self._reclaim(block=True, every=True)

    # -- which shards are in memory ----------------------------------------------
    def _fetch(self, group: FlatParamGroup) -> None:
        key = id(group)
        if key in self.in_memory:
            self.counts["in_memory"] += 1
            return
        self.counts["read_ahead" if key in self.reading else "on_demand"] += 1
        if key not in self.reading:
            self._launch_read(group, self._acquire(self.slots[key]))
        _, buf, handle = self.reading.pop(key)
        try:
            handle.wait()
        except BaseException:
            self.pool.release(self.slots[key])
            raise
        group.set_shard_storage(self._view(group, buf))
        self.in_memory[key] = (group, buf)

    def _launch_read(self, group: FlatParamGroup, buf: torch.Tensor) -> None:
        key = id(group)
        self._settle_pieces(key)
        handle = self.file.read(buf[:round_up(self.nbytes[key])], self._at(key))
        self.reading[key] = (group, buf, handle)

    def _read_ahead(self, group: FlatParamGroup) -> None:
        """Start reading the units that follow `group`'s in the recorded order of this pass."""
        order = self._order_now
        if not order:
            return
        if order is not self._order:
            self._order, self._position = order, {id(u.group): i for i, u in enumerate(order)}
        pos = self._position.get(id(group))
        if pos is None:
            return
        for unit in order[pos + 1:pos + 1 + self.lookahead]:
            self.prefetch(unit.group, keep=id(group))

    def _acquire(self, slot: int) -> torch.Tensor:
        """Buffer `slot`, freed of what it holds: the write-back in flight from it waited
        for, the shard in it evicted (after its all-gather), a read-ahead into it dropped."""
        while True:
            buf = self.pool.acquire(slot)
            if buf is not None:
                return buf
            holder = self._holder(slot)
            if holder in self.in_memory:
                reader = self.readers.get(holder)
                if reader is not None and reader.pending is not None:
                    reader.wait()  # its all-gather reads the buffer: finish it first
                self._evict(holder)
            elif holder in self.reading:
                self._forget_read(holder)
            elif any(s == slot for s, _ in self.writing):
                self._reclaim(block=True, slot=slot)
            else:
                raise OffloadError(f"{self.file.path}: parameter buffer {slot} is lent out "
                                   "and no shard holds it")

    def _holder(self, slot: int) -> int | None:
        """The shard in buffer `slot` or being read into it, if any (at most one)."""
        return next((k for k in (*self.in_memory, *self.reading) if self.slots[k] == slot), None)

    def _idle(self, key: int, clean: bool, keep: int | None = None) -> bool:
        """No all-gather is reading shard `key` (and it is unchanged, if `clean`)."""
        reader = self.readers.get(key)
        return (reader is None or reader.pending is None) and not (clean and key in self.dirty) \
            and key != keep

    def _evict(self, key: int) -> None:
        g, buf = self.in_memory.pop(key)
        g.drop_shard_storage()
        if key in self.dirty:
            self.dirty.discard(key)
            self._settle_pieces(key)
            self.writing.append((self.slots[key], self.file.write(
                buf[:round_up(self.nbytes[key])], self._at(key))))
        else:
            self.pool.release(self.slots[key])

    def _reclaim(self, block: bool, every: bool = False, slot: int | None = None) -> None:
        """Free the buffers of completed writes; if `block`, wait for the oldest write (or for
        buffer `slot`'s, and those before it)."""
        while self.writing and (block or every or self.writing[0][1].done()):
            done, handle = self.writing.popleft()
            handle.wait()
            self.pool.release(done)
            block = block and slot is not None and done != slot

    def _settle_pieces(self, key: int, begin: int = 0, end: int | None = None,
                       every: bool = False) -> None:
        """Wait for the optimizer's piece writes to the current copy of one record that overlap
        bytes [begin, end) of it (the whole record by default; `every`: both copies too); a
        failed write raises here."""
        writes = self.piece_writes.pop(key, [])
        base = self._at(key)  # the ranges are file offsets: a write to the other copy stays
        lo, hi = base + begin, base + (self.stride if end is None else end)
        keep = [] if every else [w for w in writes if w[1] <= lo or w[0] >= hi]
        if keep:
            self.piece_writes[key] = keep
        for _, _, handle in (w for w in writes if not any(w is k for k in keep)):
            handle.wait()

    def _forget_read(self, key: int) -> None:
        """Drop a read of the record still in flight (its buffer back to the pool)."""
        if key in self.reading:
            _, _, handle = self.reading.pop(key)
            try:
                handle.wait()
            finally:
                self.pool.release(self.slots[key])

    def _drain(self) -> None:
        """Finish all I/O and evict everything (clean)."""
        for key in list(self.piece_writes):
            self._settle_pieces(key, every=True)
        self.flush()
        for key in list(self.reading):
            self._forget_read(key)
        for key in list(self.in_memory):
            self._evict(key)

    @contextlib.contextmanager
    def all_in_memory(self) -> Iterator[None]:
        """All shards in their own memory inside the block, written back to the file after."""
        self._drain()
        for g in self.groups:
            buf = self._acquire(self.slots[id(g)])
            try:
                self.file.read(buf[:round_up(self.nbytes[id(g)])], self._at(id(g))).wait()
                g.set_shard_storage(self._view(g, buf).clone())
            finally:
                self.pool.release(self.slots[id(g)])
        try:
            yield
        finally:
            for g in self.groups:
                self._write_now(g, g.param_shard)
                g.drop_shard_storage()

    def file_into(self, ledger) -> None:
        ledger.add("params", "host", self.pool.arena)
        ledger.add_bytes("params", "nvme", self.file.nbytes)

    def pool_bytes(self) -> int:
        return self.pool.nbytes

    def close(self) -> None:
        handles = [h for _, _, h in self.reading.values()]
        for h in handles + [h for ws in self.piece_writes.values() for _, _, h in ws]:
            with contextlib.suppress(OffloadError):
                h.wait()
        self.reading.clear()
        self.piece_writes.clear()
