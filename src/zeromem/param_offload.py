"""Parameter homes: where the stage-3 parameter shards live (`offload_param`).

ZeRO-Offload (arXiv 2101.06840) and ZeRO-Infinity (arXiv 2104.07857, section 5)
move the fp16/bf16 parameter shard of each flat group off the device. One home
is chosen from the config by `offload.build_offload` and held by the optimizer
home there; the stage-3 fetch units and the optimizer go through it and never
branch on an offload flag (STYLE rule 3):

    OnDeviceParams (none) | HostParams (cpu) | NvmeParams (nvme, stage 3)
        swap_in(group) / swap_out(group)     `FetchUnit.unshard` swaps the shard in first
        prefetch(group)                      start bringing a shard in early
        load / store(group, start, ...)      the optimizer reads / writes shard pieces
        flush()                              step phase 5: stored values made durable
        resident()                           every shard in memory (checkpoints)

Buffer lifetimes:

- OnDeviceParams: `group.param_shard` is the shard, in device memory for the
  engine's life.
- HostParams: one (pinned) host tensor per group holds the shard for the
  engine's life; when the device is the CPU it is `group.param_shard` itself.
  Otherwise, once the stage-3 runner is attached, `group.param_shard` is
  emptied and `swap_in` gives it a device copy; at most
  `offload_param.buffer_count` copies are alive, the least recently used one
  dropped (after its all-gather finishes). `store` writes the host tensor and
  the device copy, if one is alive.
- NvmeParams: shards in the swap file params.swp (offsets aligned by
  `round_up`) and a pool of `offload_param.buffer_count` buffers, each the
  size of the largest shard. A shard is read when its unit is unsharded (and
  the shards of the next units in the recorded order are read ahead);
  `group.param_shard` is then a view into a pool buffer. It stays until
  evicted (least recently used, never while its all-gather is in flight) and
  is written back only if the optimizer changed it; the buffer goes back to
  the pool when that write completes. Inside `resident()` each shard has its
  own memory, written back to the file after the block.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from typing import Any, Iterator

import torch

from .flat import FlatParamGroup
from .swap import BufferPool, IOHandle, OffloadError, SwapSpace, round_up

__all__ = ["OnDeviceParams", "HostParams", "NvmeParams", "host_empty"]


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor, pinned if `pin` (for non-blocking copies to the device)."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


def _empty_like_shard(g: FlatParamGroup) -> torch.Tensor:
    return torch.empty(0, dtype=g.param_shard.dtype, device=g.param_shard.device)


class OnDeviceParams:
    """Parameter shards stay in device memory (no `offload_param`)."""

    place = "device"

    def swap_in(self, group: FlatParamGroup) -> None:
        """Make `group.param_shard` usable (nothing to do here)."""

    def swap_out(self, group: FlatParamGroup) -> None:
        """Release `group.param_shard`'s memory (nothing to do here)."""

    def prefetch(self, group: FlatParamGroup) -> None:
        """Start bringing `group.param_shard` in (nothing to do here)."""

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        """Copy shard elements [start, start + out.numel()) into `out`."""
        out.copy_(group.param_shard[start:start + out.numel()])

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        """Write `values` (any dtype) into the shard at `start`, in the shard's dtype."""
        group.param_shard[start:start + values.numel()].copy_(values)

    def flush(self) -> None:
        """Make stored values durable in the shard's home."""

    def attach_stage3(self, runner: Any) -> None:
        """Take over the runner's units (stage 3)."""

    def resident(self) -> contextlib.AbstractContextManager:
        """Every parameter shard in memory inside the block."""
        return contextlib.nullcontext()

    def file_into(self, ledger) -> None:
        """File this home's tensors and bytes in the memory ledger."""

    def close(self) -> None:
        """Release storage."""


class HostParams(OnDeviceParams):
    """`offload_param.device: cpu`: shards in (pinned) host memory, copied to the device on use."""

    place = "host"

    def __init__(self, groups: list[FlatParamGroup], config: Any, pin: bool):
        self.groups = groups
        self.limit = config.buffer_count
        self.resident_units: OrderedDict[int, FlatParamGroup] = OrderedDict()
        self.host = {}
        self.units: dict[int, Any] = {}
        for g in groups:
            same = g.param_shard.device.type == "cpu"  # host is the device: the shard is home
            self.host[id(g)] = g.param_shard if same else host_empty(
                g.shard_numel, g.param_shard.dtype, pin).copy_(g.param_shard)
        self.copies = any(g.param_shard.device.type != "cpu" for g in groups)

    def attach_stage3(self, runner: Any) -> None:
        for unit in runner.units:
            unit.param_home = self
            self.units[id(unit.group)] = unit
        if self.copies:
            for g in self.groups:
                g.param_shard.set_(_empty_like_shard(g))

    def swap_in(self, group: FlatParamGroup) -> None:
        if not self.copies:
            return
        key = id(group)
        if key in self.resident_units:
            self.resident_units.move_to_end(key)
            return
        while len(self.resident_units) >= self.limit:
            old = self.resident_units.popitem(last=False)[1]
            unit = self.units.get(id(old))
            if unit is not None and unit.pending is not None:
                unit.wait()  # its all-gather still reads the shard
            old.param_shard.set_(_empty_like_shard(old))
        device = group.param_shard.device
        group.param_shard.set_(self.host[key].to(device, non_blocking=True))
        self.resident_units[key] = group

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        out.copy_(self.host[id(group)][start:start + out.numel()])

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        self.host[id(group)][start:start + values.numel()].copy_(values)
        if self.copies and id(group) in self.resident_units:
            group.param_shard[start:start + values.numel()].copy_(values)

    def file_into(self, ledger) -> None:
        for t in self.host.values():
            ledger.add("params", "host", t)


class NvmeParams(OnDeviceParams):
    """`offload_param.device: nvme` (stage 3): shards in a swap file, a bounded pool in memory."""

    place = "nvme"

    def __init__(self, groups: list[FlatParamGroup], space: SwapSpace, config: Any, pin: bool):
        self.groups = groups
        self.nbytes = {id(g): g.shard_numel * g.param_shard.element_size() for g in groups}
        self.offsets, total = {}, 0
        for g in groups:
            self.offsets[id(g)] = total
            total += round_up(self.nbytes[id(g)])
        biggest = max((g.shard_numel for g in groups), default=0)
        if biggest > config.buffer_size:
            raise OffloadError(f"a parameter shard of {biggest} elements exceeds "
                               "zero_optimization.offload_param.buffer_size = "
                               f"{config.buffer_size}")
        self.pool = BufferPool(config.buffer_count, max(self.nbytes.values(), default=1), pin)
        self.file = space.file("params.swp", total)
        self.lookahead = max(1, config.buffer_count // 2)
        self.resident_bufs: OrderedDict[int, tuple[FlatParamGroup, torch.Tensor]] = OrderedDict()
        self.reading: dict[int, tuple[FlatParamGroup, torch.Tensor, IOHandle]] = {}
        self.writing: deque[tuple[torch.Tensor, IOHandle]] = deque()
        self.dirty: set[int] = set()
        self.units: dict[int, Any] = {}
        self.runner = None
        self._order, self._position = None, {}
        # how swap_in found its shard: already resident, read ahead, or read on demand
        self.counts = {"resident": 0, "read_ahead": 0, "on_demand": 0}

    # -- set-up: after the stage-3 runner gathered its persistent units ----------
    def attach_stage3(self, runner: Any) -> None:
        self.runner = runner
        for unit in runner.units:
            unit.param_home = self
            self.units[id(unit.group)] = unit
        for g in self.groups:
            self._write_now(g, g.param_shard)
            g.param_shard.set_(_empty_like_shard(g))

    def _write_now(self, g: FlatParamGroup, shard: torch.Tensor) -> None:
        buf = self._acquire()
        try:
            self._view(g, buf).copy_(shard)
            self.file.write(buf[:round_up(self.nbytes[id(g)])], self.offsets[id(g)]).wait()
        finally:
            self.pool.release(buf)

    def _view(self, g: FlatParamGroup, buf: torch.Tensor) -> torch.Tensor:
        return buf[:self.nbytes[id(g)]].view(g.param_shard.dtype)

    # -- the interface ----------------------------------------------------------
    def swap_in(self, group: FlatParamGroup) -> None:
        """Bring the shard into a pool buffer (waiting for a read-ahead), then read ahead."""
        self._fetch(group)
        self._read_ahead(group)  # never evicts `group`: its all-gather has not started yet

    def swap_out(self, group: FlatParamGroup) -> None:
        """Evict the shard (written back first when the optimizer changed it)."""
        if id(group) in self.resident_bufs:
            self._evict(id(group))

    def prefetch(self, group: FlatParamGroup, keep: int | None = None) -> None:
        key = id(group)
        if key in self.resident_bufs or key in self.reading:
            return
        self._reclaim(block=False)
        buf = self.pool.acquire()
        if buf is None:  # make room by dropping a clean shard already used (LRU), if any
            victim = self._idle(clean=True, keep=keep)
            if victim is None:
                return
            self._evict(victim)
            buf = self.pool.acquire()
        self._launch_read(group, buf)

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        self._fetch(group)
        out.copy_(group.param_shard[start:start + out.numel()])

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        self._fetch(group)
        group.param_shard[start:start + values.numel()].copy_(values)
        self.dirty.add(id(group))

    def flush(self) -> None:
        """Write every changed shard back and wait; the shards stay resident and clean."""
        handles = []
        for key in self.dirty:
            g, buf = self.resident_bufs[key]
            handles.append(self.file.write(buf[:round_up(self.nbytes[key])], self.offsets[key]))
        self.dirty.clear()
        for h in handles:
            h.wait()
        self._reclaim(block=True, every=True)

    # -- residency --------------------------------------------------------------
    def _fetch(self, group: FlatParamGroup) -> None:
        key = id(group)
        if key in self.resident_bufs:
            self.resident_bufs.move_to_end(key)
            self.counts["resident"] += 1
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
        group.param_shard.set_(self._view(group, buf))
        self.resident_bufs[key] = (group, buf)

    def _launch_read(self, group: FlatParamGroup, buf: torch.Tensor) -> None:
        key = id(group)
        handle = self.file.read(buf[:round_up(self.nbytes[key])], self.offsets[key])
        self.reading[key] = (group, buf, handle)

    def _read_ahead(self, group: FlatParamGroup) -> None:
        """Start reading the units that follow `group`'s in the recorded order of this pass."""
        runner = self.runner
        order = runner.recorded.get(runner.pass_kind) if runner is not None else None
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
            elif self.resident_bufs:
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
        for key in self.resident_bufs:
            unit = self.units.get(key)
            if (unit is None or unit.pending is None) and not (clean and key in self.dirty) \
                    and key != keep:
                return key
        return None

    def _victim(self) -> int:
        """The shard to evict for a demand read: `_idle`, else wait for the oldest gather."""
        key = self._idle(clean=False)
        if key is not None:
            return key
        key = next(iter(self.resident_bufs))
        self.units[key].wait()  # all in use by gathers in flight: finish the oldest
        return key

    def _evict(self, key: int) -> None:
        g, buf = self.resident_bufs.pop(key)
        g.param_shard.set_(_empty_like_shard(g))
        if key in self.dirty:
            self.dirty.discard(key)
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

    def _drain(self) -> None:
        """Finish all I/O and evict everything (clean)."""
        self.flush()
        for key in list(self.reading):
            _, buf, handle = self.reading.pop(key)
            handle.wait()
            self.pool.release(buf)
        for key in list(self.resident_bufs):
            self._evict(key)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """All shards in their own memory inside the block, written back to the file after."""
        self._drain()
        for g in self.groups:
            buf = self._acquire()
            try:
                self.file.read(buf[:round_up(self.nbytes[id(g)])], self.offsets[id(g)]).wait()
                g.param_shard.set_(self._view(g, buf).clone())
            finally:
                self.pool.release(buf)
        try:
            yield
        finally:
            for g in self.groups:
                self._write_now(g, g.param_shard)
                g.param_shard.set_(_empty_like_shard(g))

    def file_into(self, ledger) -> None:
        ledger.add("params", "host", self.pool.arena)
        ledger.add_bytes("params", "nvme", self.file.nbytes)

    def close(self) -> None:
        for _, buf, handle in self.reading.values():
            with contextlib.suppress(OffloadError):
                handle.wait()
        self.reading.clear()
