"""Offload: where the master shard, the optimizer states and the parameter shards live.

ZeRO-Offload (arXiv 2101.06840) keeps the fp32 master shard and the optimizer
states in host memory and runs the optimizer step on the CPU; ZeRO-Infinity
(arXiv 2104.07857, section 5) puts them, and at stage 3 the parameter shards,
in NVMe files. Two policies, chosen once from the config (STYLE rule 3), answer
every "where does this live" question; the engine and the stages call them and
never branch on an offload flag:

    optimizer home  OnDevice (none) | OnHost (cpu) | OnNvme (nvme)
        unscale_grads(groups, multiplier)   step phase 3
        optimizer.step()                     step phase 4 (the policy built it)
        write_back(groups)                   step phase 5: masters -> parameter shards
    parameter home  OnDeviceParams (none) | HostParams (cpu) | NvmeParams (nvme, stage 3)
        swap_in(group) / swap_out(group)     `FetchUnit.unshard` swaps the shard in first
        load / store(group, start, ...)      the optimizer reads / writes shard pieces

Gradients (cpu, nvme): each group's gradient object is wrapped (`GradsToHost`)
so that when its bucket's reduction finishes in the boundary backward, the
reduced shard is copied into an fp32 host buffer; the copy overlaps the rest of
backward. Host buffers live for the engine and are filed as grads/host.

NVMe optimizer (swap_optimizer.py): masters and states in a swap file, stepped
sub-group by sub-group through a pool of `buffer_count` buffers (read i+1 while
stepping i while writing i-1); host memory for optimizer state stays within
buffer_count x sub_group_size x 4 bytes.

NVMe parameters (stage 3, `NvmeParams`): shards in a swap file and a pool of
`offload_param.buffer_count` buffers. A shard is read when its unit is unsharded
(and the shards of the next units in the recorded order are read ahead); it
stays until evicted (least recently used, never while its all-gather is in
flight) and is written back only if the optimizer changed it.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict, deque
from typing import Any, Callable, Iterator

import torch

from .comm import Pending
from .flat import FlatParamGroup
from .optim import OPTIMIZERS, build_optimizer
from .swap import AsyncIO, BufferPool, IOHandle, OffloadError, SwapSpace, round_up
from .swap_optimizer import SwappedOptimizer

log = logging.getLogger("zeromem")

__all__ = ["OffloadError", "build_offload", "OnDevice", "OnHost", "OnNvme", "OnDeviceParams",
           "HostParams", "NvmeParams", "CPU_KERNEL"]

CPU_KERNEL = "fused"  # torch's fastest CPU optimizer kernel (benchmarks/bench_offload.py)


def _host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


def _empty_like_shard(g: FlatParamGroup) -> torch.Tensor:
    return torch.empty(0, dtype=g.param_shard.dtype, device=g.param_shard.device)


class GradsToHost:
    """A gradient buffer that copies its reduced shard to host after a boundary reduction."""

    def __init__(self, inner: Any, host: torch.Tensor, is_boundary: Callable[[], bool]):
        self.inner = inner
        self.host = host
        self.is_boundary = is_boundary
        self.reduces_every_microstep = inner.reduces_every_microstep

    def launch(self, comm) -> Pending:
        pending = self.inner.launch(comm)
        if not self.is_boundary():
            return pending  # stage 2 accumulates on the device until the last micro-step

        def copy_to_host() -> None:
            pending.wait()
            self.host.copy_(self.inner.reduced(), non_blocking=True)

        return Pending(None, copy_to_host)

    def __getattr__(self, name: str) -> Any:  # accumulate, reduced, zero, held, ...
        return getattr(self.inner, name)


# ---------------------------------------------------------------- parameter homes

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
            self.host[id(g)] = g.param_shard if same else _host_empty(
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


# ---------------------------------------------------------------- optimizer homes

class OnDevice:
    """No `offload_optimizer`: masters and states beside the parameters; torch's own step."""

    place = "device"

    def __init__(self, groups: list[FlatParamGroup], params_home: OnDeviceParams):
        self.groups = groups
        self.params = params_home
        self.spaces: list[SwapSpace] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.cuda = any(g.param_shard.is_cuda for g in groups)
        self._place_masters(groups)

    def _place_masters(self, groups: list[FlatParamGroup]) -> None:
        if self.params.place == "device":
            return
        for g in groups:  # the parameter shard leaves memory, but the torch step needs a master
            if g.master_aliases_params():
                g.master = g.param_shard.detach().clone()

    def build_optimizer(self, config: Any, param_groups: list[dict],
                        factory: Callable | None) -> torch.optim.Optimizer:
        """The optimizer over the master shards (see optim.build_optimizer)."""
        self.optimizer = build_optimizer(config, self.groups, param_groups, factory)
        return self.optimizer

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        """Step phase 3: `master.grad` = reduced gradient x multiplier, in fp32."""
        for g in groups:
            grad = g.grads.reduced()
            if grad.dtype == torch.float32 and multiplier == 1.0:
                g.master.grad = grad  # no copy needed
            else:
                g.master.grad = grad.to(torch.float32).mul_(multiplier)

    def write_back(self, groups: list[FlatParamGroup]) -> None:
        """Step phase 5: updated masters into the parameter shards, wherever those live."""
        for g in groups:
            if not g.master_aliases_params():
                self.params.store(g, 0, g.master)
        self.params.flush()

    def attach_stage3(self, runner: Any) -> None:
        """Let the stage-3 fetch units swap their shards in through the parameter home."""
        if runner is not None:
            self.params.attach_stage3(runner)

    resident_depth = 0  # nested resident() blocks (full_state_dict inside a checkpoint save)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every master, optimizer state and parameter shard in memory inside the block."""
        if self.resident_depth:
            yield
            return
        self.resident_depth += 1
        try:
            with self._make_resident():
                yield
        finally:
            self.resident_depth -= 1

    def _make_resident(self) -> contextlib.AbstractContextManager:
        return self.params.resident()

    def file_into(self, ledger) -> None:
        """File offloaded tensors (host) and swap files (nvme) in the memory ledger."""
        self.params.file_into(ledger)

    def close(self) -> None:
        """Wait for I/O in flight and remove the swap files."""
        self.params.close()
        for space in self.spaces:
            space.close()


class OnHost(OnDevice):
    """`offload_optimizer.device: cpu`: fp32 masters, states and gradients in host memory."""

    place = "host"

    def __init__(self, groups: list[FlatParamGroup], params_home: OnDeviceParams, pin: bool,
                 is_boundary: Callable[[], bool]):
        self.pin = pin
        self.host_grads = {id(g): _host_empty(g.shard_numel, torch.float32, pin).zero_()
                           for g in groups}
        for g in groups:
            g.grads = GradsToHost(g.grads, self.host_grads[id(g)], is_boundary)
        super().__init__(groups, params_home)

    def _place_masters(self, groups: list[FlatParamGroup]) -> None:
        for g in groups:  # its own host tensor even in fp32: the device keeps the parameter shard
            g.master = _host_empty(g.shard_numel, torch.float32, self.pin).copy_(g.master)

    def build_optimizer(self, config: Any, param_groups: list[dict],
                        factory: Callable | None) -> torch.optim.Optimizer:
        """The config's optimizer with torch's fastest CPU kernel (`CPU_KERNEL`) unless set."""
        if factory is None and config is not None and not {"fused", "foreach"} & set(config.params):
            cls = OPTIMIZERS.get(config.type.lower())
            if cls is not None:
                def factory(groups: list[dict], cls=cls) -> torch.optim.Optimizer:
                    return cls(groups, **config.params, **{CPU_KERNEL: True})
        return super().build_optimizer(config, param_groups, factory)

    def _sync(self) -> None:
        if self.cuda:  # the gradient copies were issued non-blocking
            torch.cuda.current_stream().synchronize()

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        self._sync()
        for g in groups:
            grad = self.host_grads[id(g)]
            if multiplier != 1.0:
                grad.mul_(multiplier)
            g.master.grad = grad

    def file_into(self, ledger) -> None:
        for g in self.groups:
            ledger.add("master_params", "host", g.master)
        for state in self.optimizer.state.values():
            for t in state.values():
                if torch.is_tensor(t):
                    ledger.add("optimizer_states", "host", t)
        for t in self.host_grads.values():
            ledger.add("grads", "host", t)
        super().file_into(ledger)


class OnNvme(OnHost):
    """`offload_optimizer.device: nvme`: masters and states in a swap file, stepped by sub-group."""

    place = "nvme"

    def __init__(self, groups: list[FlatParamGroup], params_home: OnDeviceParams, pin: bool,
                 is_boundary: Callable[[], bool], space: SwapSpace, config: Any,
                 sub_group_size: int):
        self.space, self.config, self.sub_group_size = space, config, sub_group_size
        super().__init__(groups, params_home, pin, is_boundary)

    def _place_masters(self, groups: list[FlatParamGroup]) -> None:
        """Masters stay until SwappedOptimizer writes them to its file (fp32: they are shards)."""

    def build_optimizer(self, config: Any, param_groups: list[dict],
                        factory: Callable | None) -> torch.optim.Optimizer:
        try:
            template = build_optimizer(config, self.groups, param_groups, factory)
            self.optimizer = SwappedOptimizer(template, self.groups, self.space, self.host_grads,
                                              self.params, self.config, self.sub_group_size,
                                              self.pin)
        except BaseException:
            self.close()  # no half-built swap files left behind
            raise
        return self.optimizer

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        self._sync()
        if multiplier != 1.0:
            for g in groups:
                self.host_grads[id(g)].mul_(multiplier)

    def write_back(self, groups: list[FlatParamGroup]) -> None:
        self.params.flush()  # the step stored every sub-group's new values already

    @contextlib.contextmanager
    def _make_resident(self) -> Iterator[None]:
        with self.params.resident(), self.optimizer.resident(self.groups):
            yield

    def file_into(self, ledger) -> None:
        opt = self.optimizer
        ledger.add("optimizer_states", "host", opt.pool.arena)
        master = sum(sg.field_bytes for sg in opt.sub_groups) if opt.master_in_file else 0
        if master:
            ledger.add_bytes("master_params", "nvme", master)
        ledger.add_bytes("optimizer_states", "nvme", opt.file.nbytes - master)
        for t in self.host_grads.values():
            ledger.add("grads", "host", t)
        self.params.file_into(ledger)


# ---------------------------------------------------------------- factory

def build_offload(config: Any, groups: list[FlatParamGroup], rank: int,
                  is_boundary: Callable[[], bool]) -> OnDevice:
    """The offload policy the config asks for (the optimizer home, holding the parameter home)."""
    zero = config.zero_optimization
    spaces: dict[str, SwapSpace] = {}
    if config.aio.use_gds and "nvme" in (zero.offload_optimizer_device, zero.offload_param_device):
        log.warning("aio.use_gds: GPUDirect Storage is not implemented; I/O goes through host "
                    "buffers")

    def space_for(block: Any) -> SwapSpace:
        if block.nvme_path not in spaces:
            spaces[block.nvme_path] = SwapSpace(block.nvme_path, rank,
                                                AsyncIO.from_config(config.aio))
        return spaces[block.nvme_path]

    try:
        params = _params_home(zero, groups, space_for)
        policy = _optimizer_home(zero, groups, params, space_for, is_boundary)
    except BaseException:
        for space in spaces.values():
            space.close()
        raise
    policy.spaces = list(spaces.values())
    if rank == 0 and policy.place != "device":
        log.info("offload: optimizer on %s, parameters on %s%s", policy.place, params.place,
                 "".join(f"; swap files in {space.dir}" for space in spaces.values()))
    return policy


def _pin(block: Any) -> bool:
    return bool(block.pin_memory) and torch.cuda.is_available()


def _params_home(zero: Any, groups: list[FlatParamGroup], space_for: Callable) -> OnDeviceParams:
    device, block = zero.offload_param_device, zero.offload_param
    if device == "none":
        return OnDeviceParams()
    if device == "cpu":
        return HostParams(groups, block, _pin(block))
    return NvmeParams(groups, space_for(block), block, _pin(block))


def _optimizer_home(zero: Any, groups: list[FlatParamGroup], params: OnDeviceParams,
                    space_for: Callable, is_boundary: Callable[[], bool]) -> OnDevice:
    device, block = zero.offload_optimizer_device, zero.offload_optimizer
    if device == "none":
        return OnDevice(groups, params)
    if block.ratio < 1:
        log.warning("offload_optimizer.ratio = %s: partial offload is not implemented; "
                    "all optimizer state is offloaded", block.ratio)
    if device == "cpu":
        return OnHost(groups, params, _pin(block), is_boundary)
    return OnNvme(groups, params, _pin(block), is_boundary, space_for(block), block,
                  zero.sub_group_size)
