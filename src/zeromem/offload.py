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

This module holds the optimizer homes and `build_offload`; the parameter homes
and their buffer lifetimes are in param_offload.py (re-exported here).

Gradients (cpu, nvme): each group's gradient object is wrapped (`GradsToHost`)
so that when its bucket's reduction finishes in the boundary backward, the
reduced shard is copied into an fp32 host buffer; the copy overlaps the rest of
backward. Host buffers live for the engine and are filed as grads/host.

NVMe optimizer (swap_optimizer.py): masters and states in a swap file, stepped
sub-group by sub-group through a pool of `buffer_count` buffers (read i+1 while
stepping i while writing i-1); host memory for optimizer state stays within
buffer_count x sub_group_size x 4 bytes.

NVMe parameters (stage 3, `NvmeParams`): shards in a swap file and a pool of
`offload_param.buffer_count` buffers (param_offload.py).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch

from .comm import Pending
from .flat import FlatParamGroup
from .optim import OPTIMIZERS, build_optimizer
from .param_offload import HostParams, NvmeParams, OnDeviceParams, host_empty
from .swap import AsyncIO, OffloadError, SwapSpace
from .swap_optimizer import SwappedOptimizer

log = logging.getLogger("zeromem")

__all__ = ["OffloadError", "build_offload", "OnDevice", "OnHost", "OnNvme", "OnDeviceParams",
           "HostParams", "NvmeParams", "CPU_KERNEL"]

CPU_KERNEL = "fused"  # torch's fastest CPU optimizer kernel (benchmarks/bench_offload.py)


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
        self.host_grads = {id(g): host_empty(g.shard_numel, torch.float32, pin).zero_()
                           for g in groups}
        for g in groups:
            g.grads = GradsToHost(g.grads, self.host_grads[id(g)], is_boundary)
        super().__init__(groups, params_home)

    def _place_masters(self, groups: list[FlatParamGroup]) -> None:
        for g in groups:  # its own host tensor even in fp32: the device keeps the parameter shard
            g.master = host_empty(g.shard_numel, torch.float32, self.pin).copy_(g.master)

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
