"""Offload: where the master shard, the optimizer states and the parameter shards live.

ZeRO-Offload (arXiv 2101.06840) keeps the fp32 master shard and the optimizer
states in host memory and runs the optimizer step on the CPU; ZeRO-Infinity
(arXiv 2104.07857, section 5) puts them, and at stage 3 the parameter shards,
in NVMe files. Vocabulary: a *placement* says where one kind of state lives,
"device", "host" or "nvme"; "offload" is only the feature (and DeepSpeed's key
names), "swap file" only the NVMe file type (offload/nvme.py).

`OffloadPolicy` (FSDP2's `OffloadPolicy`) is read once from the config; from it
`build_offload` chooses two placements, one of each kind, with no base class
between them (STYLE rule 3), and `Offload` holds them for the engine, which hands
both to the ZeRO optimizer (zero_optimizer.py); its step's phases call them:

    masters placement   MastersOnDevice | MastersOnHost | MastersOnNvme
        start_backward(boundary)            whether this backward ends a step
        unscale_grads(groups, multiplier)   step phase 3
        optimizer.step()                     step phase 4 (the placement built it)
        write_back(groups, params)           step phase 5: masters -> parameter shards
    parameter placement ParamsOnDevice | ParamsOnHost | ParamsOnNvme (offload/params.py)
        fetch(group, reader) / release(group)   `ShardedUnit.unshard` fetches the shard first
        load / store(group, start, ...)      the optimizer reads / writes shard pieces

Construction order: the parameter placement first (`build_params`, from the shard
sizes alone, before the engine builds its flat groups), which takes each group's
shard over as the group is built (`ParamPlacement.admit`: with parameters on NVMe,
written to params.swp at once); then, once the groups exist, the masters placement
(`build_offload`), which reads a master that aliases the shard (fp32) back through
the parameter placement's `load`. The stage-3 units receive `Offload.params` last.

Gradients (host, nvme): each group's gradient object is wrapped (`GradsToHost`)
so that when its bucket's reduction finishes in the boundary backward, the
reduced shard is copied into an fp32 host buffer; the copy overlaps the rest of
backward. `ZeroOptimizer.start_backward(boundary)` tells the masters placement before
each backward; the host buffers (`HostGrads`) live for the engine, filed as grads/host.

NVMe optimizer (offload/nvme_optimizer.py): masters and states in a swap file, stepped
sub-group by sub-group through a pool of `buffer_count` buffers (read i+1 while
stepping i while writing i-1); host memory for optimizer state stays within
buffer_count x sub_group_size x 4 bytes.

NVMe parameters (stage 3, `ParamsOnNvme`): shards in a swap file and a pool of
`offload_param.buffer_count` buffers (offload/params.py).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, TypeVar

import torch

from zeromem.comm import Pending
from zeromem.config.schema import (AioConfig, Config, ConfigError, OffloadOptimizerConfig,
                                   OffloadParamConfig, OptimizerConfig)
from zeromem.flat import FlatParamGroup
from zeromem.layout import BUCKETS_ALIVE
from zeromem.optimizer_factory import OPTIMIZERS, build_optimizer, has_fused_kernel
from zeromem.optimizers import Lamb
from zeromem.offload.params import (ParamPlacement, ParamsOnDevice, ParamsOnHost, ParamsOnNvme,
                            host_empty)
from zeromem.offload.budget import pool_unit_numel
from zeromem.offload.grad_file import GradFile, ShardToFile
from zeromem.offload.nvme import AsyncIO, IOStats, OffloadError, SwapSpace
from zeromem.offload.nvme_optimizer import SwappedOptimizer
from zeromem.offload.staged_masters import StagedMasters

OffloadBlock = OffloadOptimizerConfig | OffloadParamConfig
Block = TypeVar("Block", OffloadOptimizerConfig, OffloadParamConfig)

log = logging.getLogger("zeromem")

__all__ = ["OffloadError", "OffloadPolicy", "Offload", "SwapSpaces", "build_params",
           "stage_masters", "build_offload", "MastersOnDevice", "MastersOnHost", "MastersOnNvme",
           "ParamsOnDevice", "ParamsOnHost", "ParamsOnNvme", "CPU_KERNEL"]

CPU_KERNEL = "fused"  # torch's fastest CPU optimizer kernel (benchmarks/bench_offload.py)

WHERE = {"none": "device", "cpu": "host", "nvme": "nvme"}  # offload_*.device -> placement


@dataclass(frozen=True)
class OffloadPolicy:
    """Where each kind of model state lives; read once from the config, never changed."""

    optimizer: str = "device"  # masters + optimizer states: offload_optimizer.device
    params: str = "device"  # stage-3 parameter shards: offload_param.device
    optimizer_pin: bool = False  # offload_optimizer.pin_memory, and CUDA is there to use it
    params_pin: bool = False  # offload_param.pin_memory, likewise
    optimizer_block: OffloadOptimizerConfig | None = None  # offload_optimizer (buffer_count, ...)
    params_block: OffloadParamConfig | None = None  # offload_param (buffer_count, buffer_size, ...)
    # zero_optimization.sub_group_size and offload_optimizer.buffer_count when the config sets
    # them; None: sized from the host budget (offload/budget.py)
    sub_group_size: int | None = None
    optimizer_buffers: int | None = None
    host_budget_bytes: int = 64 * 2**20  # zeromem.offload_host_budget_bytes
    host_budget_set: bool = False  # the config names the budget (else its default is logged)

    @classmethod
    def from_config(cls, config: Config) -> OffloadPolicy:
        """From `zero_optimization.offload_optimizer` / `offload_param` and the host budget."""
        zero = config.zero_optimization
        opt, par = zero.offload_optimizer, zero.offload_param
        sub = int(zero.sub_group_size) if "sub_group_size" in zero.model_fields_set else None
        buffers = opt.buffer_count if opt is not None and "buffer_count" in opt.model_fields_set \
            else None
        own = config.zeromem
        return cls(WHERE[zero.offload_optimizer_device], WHERE[zero.offload_param_device],
                   _pin(opt), _pin(par), opt, par, sub, buffers, own.offload_host_budget_bytes,
                   "offload_host_budget_bytes" in own.model_fields_set)

    @property
    def optimizer_offload(self) -> OffloadOptimizerConfig:
        """The `offload_optimizer` block, asked for only where the optimizer is offloaded."""
        return _given(self.optimizer_block, "zero_optimization.offload_optimizer")

    @property
    def params_offload(self) -> OffloadParamConfig:
        """The `offload_param` block, asked for only where the parameters are offloaded."""
        return _given(self.params_block, "zero_optimization.offload_param")

    def pool_unit_numel(self, param_bytes: int, shard_world: int) -> int | None:
        """With parameters on NVMe, the largest merged fetch unit the parameter pool's share
        of the host budget allows (offload/budget.py); None: nothing to bound."""
        if self.params != "nvme":
            return None
        return pool_unit_numel(self.host_budget_bytes, self.params_offload.buffer_count,
                               param_bytes, shard_world)


def _given(block: Block | None, key: str) -> Block:
    if block is None:
        raise ConfigError(f"{key}: offload asked of a block the config does not set")
    return block


def _pin(block: OffloadBlock | None) -> bool:
    return block is not None and bool(block.pin_memory) and torch.cuda.is_available()


class GradsToHost:
    """A gradient buffer that copies its reduced shard to host after a boundary reduction."""

    def __init__(self, inner: Any, host: torch.Tensor, owner: HostGrads):  # a gradient buffer
        self.inner = inner
        self.host = host
        self.owner = owner  # holds `boundary`, set by the engine before each backward
        self.reduces_every_microstep = inner.reduces_every_microstep

    def launch(self, comm) -> Pending:
        pending = self.inner.launch(comm)
        if not self.owner.boundary:
            return pending  # stage 2 accumulates on the device until the last micro-step

        def copy_to_host() -> None:
            pending.wait()
            self.host.copy_(self.inner.reduced(), non_blocking=True)

        return Pending(None, copy_to_host)

    def __getattr__(self, name: str) -> Any:  # accumulate, reduced, zero, held, ...
        return getattr(self.inner, name)


class HostGrads:
    """fp32 host buffers the reduced gradient shards are copied into at the boundary.

    Where the reduced shard already is an fp32 host tensor (the CPU is the device), it
    is used as it is: a copy would hold the gradient twice in the same memory.
    """

    def __init__(self, groups: list[FlatParamGroup], pin: bool):
        self.buffers: dict[int, torch.Tensor] = {}
        self.boundary = False  # does the backward now running end a step (`start_backward`)
        self.cuda = any(g.param_shard.is_cuda for g in groups)
        for g in groups:
            reduced = g.grads.reduced()
            if reduced.device.type == "cpu" and reduced.dtype == torch.float32 \
                    and reduced.numel() == g.shard_numel:
                self.buffers[id(g)] = reduced
                continue
            self.buffers[id(g)] = host_empty(g.shard_numel, torch.float32, pin).zero_()
            g.attach_grads(GradsToHost(g.grads, self.buffers[id(g)], self))

    def sync(self) -> None:
        """Wait for the copies: they were issued non-blocking."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def file_into(self, ledger) -> None:
        for t in self.buffers.values():
            ledger.add("grads", "host", t)


# ---------------------------------------------------------------- masters placements

class MastersPlacement(Protocol):
    """Where masters and optimizer states live and the step runs; one verb per step phase."""

    where: str  # "device" | "host" | "nvme"
    buckets_alive: int  # full-size gradient buckets ZeroOptimizer keeps (zero_optimizer.py)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer `build_optimizer` made; None before."""

    def start_backward(self, boundary: bool) -> None:
        """The backward about to run ends a step (`boundary`) or accumulates."""

    def build_optimizer(self, config: OptimizerConfig | None, param_groups: list[dict],
                        factory: Callable | None,
                        params: ParamPlacement, device: torch.device) -> torch.optim.Optimizer:
        """The optimizer over the master shards (see optimizer_factory.build_optimizer); `device` is the
        engine's, where collectives run."""

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        """Step phase 3: the masters' gradients = reduced gradients x multiplier, in fp32."""

    def write_back(self, groups: list[FlatParamGroup], params: ParamPlacement) -> None:
        """Step phase 5: updated masters into the parameter shards, wherever those live."""

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        """Every master and optimizer state in memory inside the block."""

    def file_into(self, ledger) -> None:
        """File this placement's host and NVMe tensors in the memory ledger."""


class MastersOnDevice:
    """No `offload_optimizer`: masters and states beside the parameters; torch's own step."""

    where = "device"
    buckets_alive = BUCKETS_ALIVE

    def __init__(self, groups: list[FlatParamGroup], policy: OffloadPolicy,
                 params: ParamPlacement):
        self.groups = groups
        self.optimizer: torch.optim.Optimizer | None = None
        if policy.params != "device":  # the shards left memory, but the step needs a master
            for g in groups:
                if g.master_aliases_params():
                    shard = g.param_shard
                    master = torch.empty(g.shard_numel, dtype=shard.dtype, device=shard.device)
                    params.load(g, 0, master)
                    g.place_master(master)

    def start_backward(self, boundary: bool) -> None:
        """Nothing to do: the step reads the device gradients."""

    def build_optimizer(self, config: OptimizerConfig | None, param_groups: list[dict],
                        factory: Callable | None,
                        params: ParamPlacement, device: torch.device) -> torch.optim.Optimizer:
        self.optimizer = build_optimizer(config, self.groups, param_groups, factory, device)
        return self.optimizer

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        for g in groups:
            grad = g.grads.reduced()
            if grad.dtype == torch.float32 and multiplier == 1.0:
                g.master.grad = grad  # no copy needed
            else:
                g.master.grad = grad.to(torch.float32).mul_(multiplier)

    def write_back(self, groups: list[FlatParamGroup], params: ParamPlacement) -> None:
        _store_masters(groups, params)

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def file_into(self, ledger) -> None:
        """The engine files device tensors itself."""


class MastersOnHost:
    """`offload_optimizer.device: cpu`: fp32 masters, states and gradients in host memory."""

    where = "host"
    buckets_alive = BUCKETS_ALIVE

    def __init__(self, groups: list[FlatParamGroup], policy: OffloadPolicy,
                 params: ParamPlacement):
        self.groups = groups
        self.optimizer: torch.optim.Optimizer | None = None
        self.host_grads = HostGrads(groups, policy.optimizer_pin)
        for g in groups:  # its own host tensor even in fp32: the device keeps the parameter shard
            master = host_empty(g.shard_numel, torch.float32, policy.optimizer_pin)
            if g.master_aliases_params():  # fp32: the values are where the shard is
                params.load(g, 0, master)
            else:
                master.copy_(g.master)
            g.place_master(master)

    def start_backward(self, boundary: bool) -> None:
        self.host_grads.boundary = boundary

    def build_optimizer(self, config: OptimizerConfig | None, param_groups: list[dict],
                        factory: Callable | None,
                        params: ParamPlacement, device: torch.device) -> torch.optim.Optimizer:
        """The config's optimizer with torch's fastest CPU kernel (`CPU_KERNEL`) unless set."""
        self.optimizer = build_optimizer(config, self.groups, param_groups,
                                         factory or _cpu_kernel_factory(config), device)
        return self.optimizer

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        self.host_grads.sync()
        for g in groups:
            grad = self.host_grads.buffers[id(g)]
            if multiplier != 1.0:
                grad.mul_(multiplier)
            g.master.grad = grad

    def write_back(self, groups: list[FlatParamGroup], params: ParamPlacement) -> None:
        _store_masters(groups, params)

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # host memory is memory

    def file_into(self, ledger) -> None:
        for g in self.groups:
            ledger.add("master_params", "host", g.master)
        for state in (self.optimizer.state.values() if self.optimizer is not None else ()):
            for t in state.values():
                if torch.is_tensor(t):
                    ledger.add("optimizer_states", "host", t)
        self.host_grads.file_into(ledger)


class MastersOnNvme:
    """`offload_optimizer.device: nvme`: masters and states in a swap file, stepped by sub-group."""

    where = "nvme"

    def __init__(self, groups: list[FlatParamGroup], policy: OffloadPolicy, space: SwapSpace,
                 rank: int = 0, staged: StagedMasters | None = None):
        """Masters stay until SwappedOptimizer writes them to its file (fp32: they are shards),
        in `staged`'s file when `initialize` wrote them there as it built the groups.

        Gradients reduced every micro-step (stage 2/3) go to a swap file as reduced
        (offload/grad_file.py), so no gradient shard stays in memory; stage 1's whole
        gradient is on the device anyway, and its shard is copied to host (`HostGrads`).
        """
        self.groups, self.policy, self.space, self.rank = groups, policy, space, rank
        self.staged = staged  # handed to the optimizer, which copies and removes it
        self.optimizer: SwappedOptimizer | None = None
        self.host_grads: HostGrads | None = None
        self.grad_file: GradFile | None = None
        self.buckets_alive = BUCKETS_ALIVE
        if groups and all(g.grads.reduces_every_microstep for g in groups):
            self.grad_file = GradFile(groups, space)
            # each bucket is a whole unit in host memory (and a reducing one gloo's receive
            # buffer and its reduced shard too): one at a time keeps backward's peak to one
            # unit's gradient path; the reduction and the write still overlap the next unit's
            # backward, as its first gradient is computed before the bucket is needed
            self.buckets_alive = 1
            for g in groups:
                g.attach_grads(ShardToFile(g, g.grads.dtype, g.grads.device, self.grad_file))
        else:
            self.host_grads = HostGrads(groups, policy.optimizer_pin)

    def start_backward(self, boundary: bool) -> None:
        if self.host_grads is not None:
            self.host_grads.boundary = boundary

    def build_optimizer(self, config: OptimizerConfig | None, param_groups: list[dict],
                        factory: Callable | None,
                        params: ParamPlacement, device: torch.device) -> torch.optim.Optimizer:
        template = build_optimizer(config, self.groups, param_groups, factory, device)
        if isinstance(template, Lamb):  # a client factory's (the config's is refused at load)
            raise ConfigError("Lamb cannot step NVMe-offloaded optimizer state: its trust ratio "
                              "needs each parameter's whole update before any of it is applied, "
                              "and NVMe offload steps tile by tile; offload to \"cpu\" instead")
        policy = self.policy
        grads = self.grad_file if self.grad_file is not None else self._host().buffers
        self.optimizer = SwappedOptimizer(template, self.groups, self.space, grads, params, policy,
                                          self.staged)
        self.staged = None
        if self.rank == 0:  # the default is worth a warning: it sizes every buffer
            quiet = policy.host_budget_set and not self.optimizer.size.over_budget
            (log.info if quiet else log.warning)(
                "%s%s", self.optimizer.size.describe(),
                "" if policy.host_budget_set else " (the default: set it to your host's share)")
        return self.optimizer

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        if self.grad_file is not None:  # scaled as the step reads them
            self._built().grad_multiplier = multiplier
            return
        host = self._host()
        host.sync()
        if multiplier != 1.0:
            for g in groups:
                host.buffers[id(g)].mul_(multiplier)

    def write_back(self, groups: list[FlatParamGroup], params: ParamPlacement) -> None:
        params.flush()  # the step stored every sub-group's new values already

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        return self._built().all_in_memory(self.groups)

    def file_into(self, ledger) -> None:
        opt = self._built()
        ledger.add("optimizer_states", "host", opt.pool.arena)
        master = opt.layout.master_nbytes
        if master:
            ledger.add_bytes("master_params", "nvme", master)
        ledger.add_bytes("optimizer_states", "nvme", opt.file.nbytes - master)
        if self.grad_file is not None:
            ledger.add_bytes("grads", "nvme", self.grad_file.file.nbytes)
        else:
            self._host().file_into(ledger)

    def _built(self) -> SwappedOptimizer:
        if self.optimizer is None:
            raise RuntimeError("the NVMe optimizer is used before build_optimizer() made it")
        return self.optimizer

    def _host(self) -> HostGrads:
        """Stage 1's host gradient buffers (stages 2/3 keep gradients in `grad_file`)."""
        if self.host_grads is None:
            raise RuntimeError("stage 2/3 NVMe offload keeps gradients in a swap file, not on host")
        return self.host_grads


def _store_masters(groups: list[FlatParamGroup], params: ParamPlacement) -> None:
    for g in groups:
        if not g.master_aliases_params():
            params.store(g, 0, g.master)
    params.flush()


def _cpu_kernel_factory(config: OptimizerConfig | None) -> Callable | None:
    """A factory adding `CPU_KERNEL` to the config's optimizer, unless the config sets one."""
    if config is None or {"fused", "foreach"} & set(config.params):
        return None
    cls = config.torch_class
    if cls not in OPTIMIZERS.values() or not has_fused_kernel(cls):
        return None

    def factory(groups: list[dict]) -> torch.optim.Optimizer:
        options: dict[str, Any] = {**config.params, CPU_KERNEL: True}
        return cls(groups, **options)
    return factory


# ---------------------------------------------------------------- the pair, for the engine

class Offload:
    """`engine.offload`: the two placements chosen from one `OffloadPolicy`, and their files.

    `masters` answers where masters and optimizer states live and runs the step
    phases; `params` answers where the parameter shards live. Both are handed to
    the ZeRO optimizer (zero_optimizer.py), and `params` to the stage-3 fetch units,
    when those are built: the step's phases call the placements directly.
    """

    def __init__(self, policy: OffloadPolicy, masters: MastersPlacement, params: ParamPlacement,
                 spaces: list[SwapSpace]):
        self.policy = policy
        self.masters = masters
        self.params = params
        self.spaces = spaces
        self.depth = 0  # nested all_in_memory() blocks (full_state_dict inside a save)
        self.io_last_step = IOStats()  # swap I/O of the last optimizer step (`end_step`)
        self._io_mark = IOStats()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.masters.optimizer

    @property
    def buckets_alive(self) -> int:
        """Full-size gradient buckets ZeroOptimizer keeps, filling or reducing."""
        return self.masters.buckets_alive

    def build_optimizer(self, config: OptimizerConfig | None, param_groups: list[dict],
                        factory: Callable | None,
                        device: torch.device) -> torch.optim.Optimizer:
        """The optimizer over the master shards, stepped where the masters live; `device` is
        the engine's (collectives over host masters go through it under NCCL)."""
        try:
            return self.masters.build_optimizer(config, param_groups, factory, self.params,
                                                device)
        except BaseException:
            self.close()  # no half-built swap files left behind
            raise

    @contextlib.contextmanager
    def all_in_memory(self) -> Iterator[None]:
        """Every master, optimizer state and parameter shard in memory inside the block."""
        if self.depth:
            yield
            return
        self.depth += 1
        try:
            with self.params.all_in_memory(), self.masters.all_in_memory():
                yield
        finally:
            self.depth -= 1

    def file_into(self, ledger) -> None:
        """File host tensors and NVMe bytes in the memory ledger."""
        self.masters.file_into(ledger)
        self.params.file_into(ledger)

    def io_total(self) -> IOStats:
        """Swap bytes read and written, and time blocked on them, since construction."""
        total = IOStats()
        for space in self.spaces:
            total = total.plus(space.io.stats)
        return total

    def end_step(self) -> None:
        """At each optimizer step's end: the I/O since the last one becomes `io_last_step`."""
        total = self.io_total()
        self.io_last_step, self._io_mark = total.minus(self._io_mark), total

    def io_report(self) -> dict[str, dict[str, float]]:
        """{"last_step": ..., "total": ...}: read_bytes, written_bytes, wait_s (NVMe swap I/O)."""
        return {"last_step": vars(self.io_last_step).copy(), "total": vars(self.io_total())}

    def close(self) -> None:
        """Wait for I/O in flight and remove the swap files."""
        self.params.close()
        for space in self.spaces:
            space.close()


# ---------------------------------------------------------------- factory

class SwapSpaces:
    """An engine's swap directories, one per `nvme_path` (masters and parameters may share one)."""

    def __init__(self, config: Config, rank: int):
        self.aio: AioConfig = config.aio
        self.rank = rank
        self.by_path: dict[str, SwapSpace] = {}

    def for_block(self, block: OffloadBlock) -> SwapSpace:
        """The space under `block.nvme_path`, created on first use."""
        path = block.nvme_path
        if path is None:  # the config refuses device nvme without a path; kept for direct callers
            raise ConfigError("offload to nvme needs nvme_path")
        if path not in self.by_path:
            self.by_path[path] = SwapSpace(path, self.rank, AsyncIO.from_config(self.aio))
        return self.by_path[path]

    def all(self) -> list[SwapSpace]:
        return list(self.by_path.values())

    def close(self) -> None:
        for space in self.by_path.values():
            space.close()


def build_params(config: Config, shard_numels: list[int], dtype: torch.dtype, device: torch.device,
                 spaces: SwapSpaces) -> ParamPlacement:
    """The parameter placement, before the flat groups exist: `shard_numels` are the shards
    the engine will build, in order; each is handed over (`admit`) as soon as it is built."""
    policy = OffloadPolicy.from_config(config)
    if policy.params == "device":
        return ParamsOnDevice()
    block = policy.params_offload
    if policy.params == "host":
        return ParamsOnHost(block, policy.params_pin, device)
    try:
        return ParamsOnNvme(shard_numels, dtype, device, spaces.for_block(block), block,
                            policy.params_pin)
    except BaseException:
        spaces.close()
        raise


def stage_masters(config: Config, shard_numels: list[int], dtype: torch.dtype,
                  spaces: SwapSpaces) -> StagedMasters | None:
    """With the optimizer on NVMe, stage 3 and masters apart from the shards (16-bit compute):
    the file each group's master is written to as it is built (offload/staged_masters.py)."""
    policy = OffloadPolicy.from_config(config)
    if policy.optimizer != "nvme" or dtype == torch.float32 or not shard_numels:
        return None
    try:
        return StagedMasters(shard_numels, spaces.for_block(policy.optimizer_offload))
    except BaseException:
        spaces.close()
        raise


def build_offload(config: Config, groups: list[FlatParamGroup], params: ParamPlacement,
                  spaces: SwapSpaces, rank: int, staged: StagedMasters | None = None) -> Offload:
    """The masters placement the config asks for, beside the parameter placement the groups'
    shards were handed to (`build_params`) and, 16-bit, the masters written as they were
    built (`stage_masters`)."""
    policy = OffloadPolicy.from_config(config)
    if config.aio.use_gds and "nvme" in (policy.optimizer, policy.params):
        log.warning("aio.use_gds: GPUDirect Storage is not implemented; I/O goes through host "
                    "buffers")
    try:
        masters = _masters_placement(policy, groups, params, spaces, rank, staged)
    except BaseException:
        spaces.close()
        raise
    if rank == 0 and policy.optimizer != "device":
        log.info("offload: optimizer on %s, parameters on %s%s", policy.optimizer, policy.params,
                 "".join(f"; swap files in {space.dir}" for space in spaces.all()))
    return Offload(policy, masters, params, spaces.all())


def _masters_placement(policy: OffloadPolicy, groups: list[FlatParamGroup],
                       params: ParamPlacement, spaces: SwapSpaces, rank: int,
                       staged: StagedMasters | None) -> MastersPlacement:
    if policy.optimizer == "device":
        return MastersOnDevice(groups, policy, params)
    if policy.optimizer_offload.ratio < 1:
        log.warning("offload_optimizer.ratio = %s: partial offload is not implemented; "
                    "all optimizer state is offloaded", policy.optimizer_offload.ratio)
    if policy.optimizer == "host":
        return MastersOnHost(groups, policy, params)
    return MastersOnNvme(groups, policy, spaces.for_block(policy.optimizer_offload), rank, staged)
