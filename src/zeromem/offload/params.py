"""Parameter placements: where the stage-3 parameter shards live (`offload_param`).

ZeRO-Offload (arXiv 2101.06840) and ZeRO-Infinity (arXiv 2104.07857, section 5)
move the fp16/bf16 parameter shard of each flat group off the device. One
placement is chosen from the `OffloadPolicy` by `offload.build_offload`, before
the stage-3 fetch units are built, and passed to them; the fetch units and the
optimizer go through it and never branch on an offload flag (STYLE rule 3).
The three classes share no base class; each implements `ParamPlacement`:

    ParamsOnDevice (none) | ParamsOnHost (cpu) | ParamsOnNvme (nvme, stage 3)
        admit(group)             take a group's shard over, as the engine builds the group
        fetch(group, reader)     `ShardedUnit.unshard`: the shard in memory before its gather
        release(group)           the shard's memory given back (written out first if changed)
        prefetch(group)          start bringing a shard in early
        follow(order)            the runner's recorded unit order for the pass now running
        load / store(group, start, ...)   the optimizer reads / writes shard pieces
        read_piece / write_piece(...)        the same for the NVMe optimizer's fp32 masters,
                                 through its own aligned buffer (no parameter buffer held)
        flush()                  step phase 5: stored values reach the shard's place
        all_in_memory()          every shard in memory inside the block (checkpoints)

A placement is built before the flat groups, from the shard sizes alone, and takes
each group's shard over as soon as the engine has built it (`admit`): the host and
NVMe ones copy the shard to its place and empty `group.param_shard` at once. So
under `zeromem.Init` no rank ever holds every parameter shard in memory: the NVMe
file is laid out before the groups exist and each shard is written as it is made
(ZeRO-Infinity's "infinity offload engine" at initialisation). A master that
aliases the shard (fp32) is read back through `load` by the masters placement.

Buffer lifetimes:

- ParamsOnDevice: `group.param_shard` is the shard, in device memory for the
  engine's life.
- ParamsOnHost: one (pinned) host tensor per group holds the shard for the
  engine's life; when the device is the CPU it is `group.param_shard` itself.
  Otherwise `group.param_shard` is emptied at construction and `fetch` gives
  it a device copy; at most `offload_param.buffer_count` copies are alive, the
  least recently used one dropped (after the all-gather reading it finishes).
  `store` writes the host tensor and the device copy, if one is alive.
- ParamsOnNvme: shards in the file params.swp (offsets aligned by `round_up`)
  and a pool of `offload_param.buffer_count` buffers, each the size of the
  largest shard. A shard is read when its unit is unsharded (and the shards of
  the next units in the followed order are read ahead); `group.param_shard` is
  then a view into a pool buffer. It stays until released (least recently
  used, never while its all-gather is in flight) and is written back only if
  the optimizer changed it; the buffer goes back to the pool when that write
  completes. Inside `all_in_memory()` each shard has its own memory, written
  back to the file after the block.
  The NVMe optimizer's fp32 step (where the master is the shard) reads and writes
  its pieces of params.swp straight from its own buffers (`read_piece` /
  `write_piece`), so the step holds no pool buffer and waits on no eviction; the
  writes are left in flight and waited for before that record is next read or
  written (`piece_writes`). A block that two pieces of a shard share (sub-groups
  cut shards anywhere) is written once, by the later piece, which takes the
  earlier piece's bytes of it from `boundary` (pieces are stepped in order).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from typing import Any, Iterator, Protocol, Sequence

import torch

from zeromem.config.schema import OffloadParamConfig
from zeromem.flat import FlatParamGroup
from zeromem.offload.nvme import (ALIGN, BufferPool, IOHandle, OffloadError, SwapSpace,
                                  piece_range, piece_view, round_up)

__all__ = ["ParamPlacement", "ParamsOnDevice", "ParamsOnHost", "ParamsOnNvme", "host_empty"]


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor, pinned if `pin` (for non-blocking copies to the device)."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


class Reader(Protocol):
    """What reads a shard while it is in memory: a stage-3 `ShardedUnit` and its all-gather."""

    pending: Any  # the all-gather in flight, or None

    def wait(self) -> None:
        """Finish the all-gather (after which the shard may leave memory)."""


class ParamPlacement(Protocol):
    """Where the parameter shards live; the verbs every parameter placement offers."""

    where: str  # "device" | "host" | "nvme"

    def admit(self, group: FlatParamGroup) -> None:
        """Take over `group.param_shard` (the groups arrive in the order of the sizes given)."""

    def fetch(self, group: FlatParamGroup, reader: Reader | None = None) -> None:
        """Make `group.param_shard` usable; `reader`'s all-gather will read it."""

    def release(self, group: FlatParamGroup) -> None:
        """Give `group.param_shard`'s memory back (written to its place first if changed)."""

    def prefetch(self, group: FlatParamGroup) -> None:
        """Start bringing `group.param_shard` in."""

    def follow(self, order: Sequence[Any] | None) -> None:
        """The fetch units in the order the pass now running recorded (None: not recorded)."""

    def prefetch_numel(self, configured: int, set_in_config: bool) -> int:
        """Elements the stage-3 schedule may gather ahead (stage3_prefetch_bucket_size)."""

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        """Copy shard elements [start, start + out.numel()) into `out`."""

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        """Write `values` (any dtype) into the shard at `start`, in the shard's dtype."""

    def read_piece(self, group: FlatParamGroup, start: int, numel: int,
                   buf: torch.Tensor) -> IOHandle | None:
        """Start bringing fp32 shard elements [start, start + numel) to `piece_view(start, numel,
        buf)` (`buf`: aligned uint8, `piece_bytes(numel)` long); None when already there."""

    def write_piece(self, group: FlatParamGroup, start: int, numel: int,
                    buf: torch.Tensor) -> list[IOHandle]:
        """Store the piece at `piece_view(start, numel, buf)` as those shard elements (pieces
        of a shard in increasing order within a step); the writes `buf` must outlive."""

    def flush(self) -> None:
        """Make stored values durable in the shard's place."""

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        """Every parameter shard in memory inside the block."""

    def file_into(self, ledger) -> None:
        """File this placement's tensors and bytes in the memory ledger."""

    def pool_bytes(self) -> int:
        """Host bytes of its staging pool, taken from the NVMe host budget (offload/budget.py)."""

    def close(self) -> None:
        """Release storage."""


class ParamsOnDevice:
    """Parameter shards stay in device memory (no `offload_param`)."""

    where = "device"

    def admit(self, group: FlatParamGroup) -> None:
        """Nothing to do: the shard stays in device memory."""

    def fetch(self, group: FlatParamGroup, reader: Reader | None = None) -> None:
        """Nothing to do: the shard is in device memory."""

    def release(self, group: FlatParamGroup) -> None:
        """Nothing to do: the shard stays."""

    def prefetch(self, group: FlatParamGroup) -> None:
        """Nothing to do: the shard is in device memory."""

    def follow(self, order: Sequence[Any] | None) -> None:
        """Nothing is read ahead."""

    def prefetch_numel(self, configured: int, set_in_config: bool) -> int:
        return configured

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        out.copy_(group.param_shard[start:start + out.numel()])

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        group.param_shard[start:start + values.numel()].copy_(values)

    def read_piece(self, group: FlatParamGroup, start: int, numel: int,
                   buf: torch.Tensor) -> IOHandle | None:
        self.load(group, start, piece_view(start, numel, buf))
        return None

    def write_piece(self, group: FlatParamGroup, start: int, numel: int,
                    buf: torch.Tensor) -> list[IOHandle]:
        self.store(group, start, piece_view(start, numel, buf))
        return []

    def flush(self) -> None:
        """Stores went straight into the shard."""

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def file_into(self, ledger) -> None:
        """The engine files the device shards itself."""

    def pool_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """No storage of its own."""


class ParamsOnHost:
    """`offload_param.device: cpu`: shards in (pinned) host memory, copied to the device on use."""

    where = "host"

    def __init__(self, config: OffloadParamConfig, pin: bool, device: torch.device):
        self.groups: list[FlatParamGroup] = []
        self.limit = config.buffer_count
        self.pin = pin
        self.in_memory: OrderedDict[int, FlatParamGroup] = OrderedDict()  # device copies, LRU
        self.host: dict[int, torch.Tensor] = {}
        self.readers: dict[int, Reader] = {}
        self.copies = device.type != "cpu"  # else host is the device: shards already in place

    def admit(self, group: FlatParamGroup) -> None:
        """The host tensor becomes the truth (the device's shard is dropped)."""
        self.groups.append(group)
        shard = group.param_shard
        self.host[id(group)] = host_empty(group.shard_numel, shard.dtype, self.pin).copy_(
            shard) if self.copies else shard
        if self.copies:
            group.drop_shard_storage()

    def fetch(self, group: FlatParamGroup, reader: Reader | None = None) -> None:
        """A device copy of the shard (dropping the least recently used one beyond the limit)."""
        if not self.copies:
            return
        key = id(group)
        if reader is not None:
            self.readers[key] = reader
        if key in self.in_memory:
            self.in_memory.move_to_end(key)
            return
        while len(self.in_memory) >= self.limit:
            old = self.in_memory.popitem(last=False)[1]
            reader_of_old = self.readers.get(id(old))
            if reader_of_old is not None and reader_of_old.pending is not None:
                reader_of_old.wait()  # its all-gather still reads the shard
            old.drop_shard_storage()
        device = group.param_shard.device
        group.set_shard_storage(self.host[key].to(device, non_blocking=True))
        self.in_memory[key] = group

    def release(self, group: FlatParamGroup) -> None:
        """Drop the device copy (the host tensor always holds the values)."""
        if self.copies and self.in_memory.pop(id(group), None) is not None:
            group.drop_shard_storage()

    def prefetch(self, group: FlatParamGroup) -> None:
        """Copies are made on `fetch` only."""

    def follow(self, order: Sequence[Any] | None) -> None:
        """Nothing is read ahead."""

    def prefetch_numel(self, configured: int, set_in_config: bool) -> int:
        return configured

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        out.copy_(self.host[id(group)][start:start + out.numel()])

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        self.host[id(group)][start:start + values.numel()].copy_(values)
        if self.copies and id(group) in self.in_memory:
            group.param_shard[start:start + values.numel()].copy_(values)

    def read_piece(self, group: FlatParamGroup, start: int, numel: int,
                   buf: torch.Tensor) -> IOHandle | None:
        self.load(group, start, piece_view(start, numel, buf))
        return None

    def write_piece(self, group: FlatParamGroup, start: int, numel: int,
                    buf: torch.Tensor) -> list[IOHandle]:
        self.store(group, start, piece_view(start, numel, buf))
        return []

    def flush(self) -> None:
        """Stores went straight into the host tensors."""

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        """The host tensors are in memory already."""
        return contextlib.nullcontext()

    def file_into(self, ledger) -> None:
        for t in self.host.values():
            ledger.add("params", "host", t)

    def pool_bytes(self) -> int:
        return 0  # the shards themselves live in host memory, outside any staging budget

    def close(self) -> None:
        """Host tensors are freed with the placement."""


class ParamsOnNvme:
    """`offload_param.device: nvme` (stage 3): shards in a file, a bounded pool in memory."""

    where = "nvme"

    def __init__(self, shard_numels: Sequence[int], dtype: torch.dtype, device: torch.device,
                 space: SwapSpace, config: OffloadParamConfig, pin: bool):
        """params.swp laid out for shards of `shard_numels` elements (in `admit` order)."""
        self.groups: list[FlatParamGroup] = []
        self.host_is_device = device.type == "cpu"
        self.largest_unit_numel = 0  # the largest group admitted (whole, padded)
        self.dtype = dtype
        self.planned = [n * dtype.itemsize for n in shard_numels]  # bytes, in admit order
        self.planned_offsets, total = [], 0
        for nbytes in self.planned:
            self.planned_offsets.append(total)
            total += round_up(nbytes)
        biggest = max(shard_numels, default=0)
        if biggest > config.buffer_size:
            raise OffloadError(f"a parameter shard of {biggest} elements exceeds "
                               "zero_optimization.offload_param.buffer_size = "
                               f"{config.buffer_size}")
        self.nbytes: dict[int, int] = {}  # group id -> bytes of its shard
        self.offsets: dict[int, int] = {}  # group id -> its record in params.swp
        self.pool = BufferPool(config.buffer_count, max(self.planned, default=1), pin)
        self.file = space.file("params.swp", total)
        self.lookahead = max(1, config.buffer_count // 2)
        self.in_memory: OrderedDict[int, tuple[FlatParamGroup, torch.Tensor]] = OrderedDict()
        self.reading: dict[int, tuple[FlatParamGroup, torch.Tensor, IOHandle]] = {}
        self.writing: deque[tuple[torch.Tensor, IOHandle]] = deque()
        self.dirty: set[int] = set()
        self.readers: dict[int, Reader] = {}
        # the optimizer's piece writes in flight, per group id, with their byte ranges: waited
        # before that range is next read (the read would miss them) or the record written
        # whole (two writes land in either order); a step's pieces never overlap each other
        self.piece_writes: dict[int, list[tuple[int, int, IOHandle]]] = {}
        # (group id, block offset) -> that block as the earlier of two pieces sharing it left it
        self.boundary: dict[tuple[int, int], torch.Tensor] = {}
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
                or group.param_shard.dtype != self.dtype:
            raise AssertionError(f"{self.file.path}: group {index} of {nbytes} bytes "
                                 f"({group.param_shard.dtype}) was not laid out")
        self.groups.append(group)
        self.nbytes[id(group)] = nbytes
        self.offsets[id(group)] = self.planned_offsets[index]
        self.largest_unit_numel = max(self.largest_unit_numel, group.padded_numel)
        self._write_now(group, group.param_shard)
        group.drop_shard_storage()

    def _write_now(self, g: FlatParamGroup, shard: torch.Tensor) -> None:
        self._settle_pieces(id(g))
        buf = self._acquire()
        try:
            self._view(g, buf).copy_(shard)
            self.file.write(buf[:round_up(self.nbytes[id(g)])], self.offsets[id(g)]).wait()
        finally:
            self.pool.release(buf)

    def _view(self, g: FlatParamGroup, buf: torch.Tensor) -> torch.Tensor:
        return buf[:self.nbytes[id(g)]].view(self.dtype)

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
        buf = self.pool.acquire()
        if buf is None:  # make room by dropping a clean shard already used (LRU), if any
            victim = self._idle(clean=True, keep=keep)
            if victim is None:
                return
            self._evict(victim)
            buf = self.pool.acquire()
            assert buf is not None  # the eviction freed one
        self._launch_read(group, buf)

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        self._fetch(group)
        out.copy_(group.param_shard[start:start + out.numel()])

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        self._fetch(group)
        group.param_shard[start:start + values.numel()].copy_(values)
        self.dirty.add(id(group))

    def read_piece(self, group: FlatParamGroup, start: int, numel: int,
                   buf: torch.Tensor) -> IOHandle | None:
        """From the shard in memory if it is there (no I/O), else from params.swp."""
        key = id(group)
        begin, length = piece_range(start, numel)
        if key in self.in_memory:
            buf[:length].copy_(self.in_memory[key][1][begin:begin + length])
            return None
        self._settle_pieces(key, begin, begin + length)
        return self.file.read(buf[:length], self.offsets[key] + begin)

    def write_piece(self, group: FlatParamGroup, start: int, numel: int,
                    buf: torch.Tensor) -> list[IOHandle]:
        """Write the piece's blocks from `buf`, but a last block the next piece shares: that one
        is kept in `boundary` and written by the next piece, with its own bytes."""
        key = id(group)
        if key in self.in_memory:  # the copy in memory stays current: the next forward uses it
            group.param_shard[start:start + numel].copy_(piece_view(start, numel, buf))
        self._forget_read(key)  # a read in flight would bring the old values
        begin, length = piece_range(start, numel)
        head = start * 4 - begin
        if head:  # the first block is shared with the piece before, stepped before this one
            earlier = self.boundary.pop((key, begin), None)
            if earlier is None:
                raise OffloadError(f"{self.file.path}: a piece at element {start} is written "
                                   "before the piece that shares its first block")
            buf[:head].copy_(earlier[:head])
        end, stop = begin + length, (start + numel) * 4
        if stop % ALIGN and stop < self.nbytes[key]:  # the last block is the next piece's too
            end -= ALIGN
            self.boundary[(key, end)] = buf[end - begin:end - begin + ALIGN].clone()
        if end == begin:
            return []
        handle = self.file.write(buf[:end - begin], self.offsets[key] + begin)
        self.piece_writes.setdefault(key, []).append((begin, end, handle))
        return [handle]

    def flush(self) -> None:
        """Write every changed shard back and wait; the shards stay in memory, clean."""
        handles = []
        for key in self.dirty:
            g, buf = self.in_memory[key]
            self._settle_pieces(key)
            handles.append(self.file.write(buf[:round_up(self.nbytes[key])], self.offsets[key]))
        self.dirty.clear()
        for h in handles:
            h.wait()
        self._reclaim(block=True, every=True)

    # -- which shards are in memory ----------------------------------------------
    def _fetch(self, group: FlatParamGroup) -> None:
        key = id(group)
        if key in self.in_memory:
            self.in_memory.move_to_end(key)
            self.counts["in_memory"] += 1
            return
        self.counts["read_ahead" if key in self.reading else "on_demand"] += 1
        if key not in self.reading:
            self._launch_read(group, self._acquire())
        _, buf, handle = self.reading.pop(key)
        try:
            handle.wait()
        except BaseException:
            self.pool.release(buf)
            raise
        group.set_shard_storage(self._view(group, buf))
        self.in_memory[key] = (group, buf)

    def _launch_read(self, group: FlatParamGroup, buf: torch.Tensor) -> None:
        key = id(group)
        self._settle_pieces(key)
        handle = self.file.read(buf[:round_up(self.nbytes[key])], self.offsets[key])
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

    def _acquire(self) -> torch.Tensor:
        """A free buffer: reclaim finished writes, evict the least recently used shard, or wait."""
        while True:
            buf = self.pool.acquire()
            if buf is not None:
                return buf
            if self.writing:
                self._reclaim(block=True)
            elif self.in_memory:
                self._evict(self._victim())
            elif self.reading:  # only read-aheads hold buffers: drop the oldest
                key = next(iter(self.reading))
                _, buf, handle = self.reading.pop(key)
                handle.wait()
                self.pool.release(buf)
            else:
                raise OffloadError(f"offload_param.buffer_count = {self.pool.count} buffers, all "
                                   "in use")

    def _idle(self, clean: bool, keep: int | None = None) -> int | None:
        """The least recently used shard no all-gather is reading (and unchanged, if `clean`)."""
        for key in self.in_memory:
            reader = self.readers.get(key)
            if (reader is None or reader.pending is None) and not (clean and key in self.dirty) \
                    and key != keep:
                return key
        return None

    def _victim(self) -> int:
        """The shard to evict for a demand read: `_idle`, else wait for the oldest gather."""
        key = self._idle(clean=False)
        if key is not None:
            return key
        key = next(iter(self.in_memory))
        self.readers[key].wait()  # all in use by gathers in flight: finish the oldest
        return key

    def _evict(self, key: int) -> None:
        g, buf = self.in_memory.pop(key)
        g.drop_shard_storage()
        if key in self.dirty:
            self.dirty.discard(key)
            self._settle_pieces(key)
            self.writing.append((buf, self.file.write(buf[:round_up(self.nbytes[key])],
                                                      self.offsets[key])))
        else:
            self.pool.release(buf)

    def _reclaim(self, block: bool, every: bool = False) -> None:
        """Return the buffers of completed writes (waiting for the oldest if `block`)."""
        while self.writing and (block or every or self.writing[0][1].done()):
            buf, handle = self.writing.popleft()
            handle.wait()
            self.pool.release(buf)
            block = False

    def _settle_pieces(self, key: int, begin: int = 0, end: int | None = None) -> None:
        """Wait for the optimizer's piece writes of one record that overlap bytes [begin, end)
        (all by default); a failed write raises here."""
        writes = self.piece_writes.pop(key, [])
        keep = [w for w in writes if end is not None and (w[1] <= begin or w[0] >= end)]
        if keep:
            self.piece_writes[key] = keep
        for _, _, handle in (w for w in writes if not any(w is k for k in keep)):
            handle.wait()

    def _forget_read(self, key: int) -> None:
        """Drop a read of the record still in flight (its buffer back to the pool)."""
        if key in self.reading:
            _, buf, handle = self.reading.pop(key)
            try:
                handle.wait()
            finally:
                self.pool.release(buf)

    def _drain(self) -> None:
        """Finish all I/O and evict everything (clean)."""
        for key in list(self.piece_writes):
            self._settle_pieces(key)
        self.flush()
        for key in list(self.reading):
            _, buf, handle = self.reading.pop(key)
            handle.wait()
            self.pool.release(buf)
        for key in list(self.in_memory):
            self._evict(key)

    @contextlib.contextmanager
    def all_in_memory(self) -> Iterator[None]:
        """All shards in their own memory inside the block, written back to the file after."""
        self._drain()
        for g in self.groups:
            buf = self._acquire()
            try:
                self.file.read(buf[:round_up(self.nbytes[id(g)])], self.offsets[id(g)]).wait()
                g.set_shard_storage(self._view(g, buf).clone())
            finally:
                self.pool.release(buf)
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
