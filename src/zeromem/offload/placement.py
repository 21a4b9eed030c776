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

    masters placement   MastersOnDevice | MastersOnHost | MastersOnNvme (offload/masters.py)
        start_backward(boundary)            whether this backward ends a step
        unscale_grads(groups, multiplier)   step phase 3
        optimizer.step()                     step phase 4 (the placement built it)
        finish_io()                          I/O the step left in flight (close)
        write_back(groups, params)           step phase 5: masters -> parameter shards
    parameter placement ParamsOnDevice | ParamsOnHost (offload/params.py) | ParamsOnNvme (params_nvme.py)
        fetch(group, reader) / release(group)   `ShardedUnit.unshard` fetches the shard first
        load / store(group, start, ...)      the optimizer reads / writes shard pieces

Construction order: the parameter placement first (`build_params`, from the shard
sizes alone, before the engine builds its flat groups), which takes each group's
shard over as the group is built (`ParamPlacement.admit`: with parameters on NVMe,
written to params.swp at once); then, once the groups exist, the masters placement
(`build_offload`), which reads a master that aliases the shard (fp32) back through
the parameter placement's `load`. The stage-3 units receive `Offload.params` last.

Gradients (host, nvme): `build_grads` builds each group's gradient buffer knowing
where its reduced gradient goes (FSDP2's OffloadPolicy), before the masters placement,
which is handed that destination: with `masters.HostGrads`, when a bucket's reduction
finishes in the boundary backward, the reduced shard is copied into an fp32 host
buffer (the copy overlaps the rest of backward; `ZeroOptimizer.start_backward(boundary)`
tells the masters placement before each backward; the host buffers live for the engine,
filed as grads/host); with `grad_file.GradFile` (the optimizer on NVMe, stages 2-3) it
is written to grads.swp as reduced (`ShardToFile`).

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
from typing import Any, Callable, Iterator, TypeVar

import torch

from zeromem.config.schema import (OFFLOAD_HOST_BUDGET_BYTES, AioConfig, Config, ConfigError,
                                   OffloadOptimizerConfig, OffloadParamConfig, OptimizerConfig,
                                   ZeroConfig)
from zeromem.flat import (ContiguousShards, FlatParamGroup, ShardAccumulated, WholeAllReduced,
                          WholeScattered)
from zeromem.layout import Sharding
from zeromem.offload.grad_file import GradFile, ShardToFile
from zeromem.offload.params import ParamPlacement, ParamsOnDevice, ParamsOnHost
from zeromem.offload.params_nvme import ParamsOnNvme
from zeromem.offload.budget import MIN_SUB_GROUP, pool_unit_numel
from zeromem.offload.nvme import AsyncIO, IOStats, OffloadError, SwapSpace
from zeromem.offload.staged_masters import StagedMasters
from zeromem.offload.masters import (CPU_KERNEL, HostGrads, MastersOnDevice, MastersOnHost,
                                     MastersOnNvme, MastersPlacement)

OffloadBlock = OffloadOptimizerConfig | OffloadParamConfig
Block = TypeVar("Block", OffloadOptimizerConfig, OffloadParamConfig)

log = logging.getLogger("zeromem")

__all__ = ["OffloadError", "OffloadPolicy", "Offload", "SwapSpaces", "build_params",
           "stage_masters", "build_grads", "build_offload", "MastersOnDevice", "MastersOnHost",
           "MastersOnNvme", "ParamsOnDevice", "ParamsOnHost", "ParamsOnNvme", "CPU_KERNEL"]

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
    host_budget_bytes: int = OFFLOAD_HOST_BUDGET_BYTES
    host_budget_set: bool = False  # the config names the budget (else its default is logged)
    # masters and parameters on NVMe, no fp16: the files keep two copies so that the step
    # may begin in the boundary backward (offload/backward_step.py)
    step_in_backward: bool = False

    @classmethod
    def from_config(cls, config: Config) -> OffloadPolicy:
        """From `zero_optimization.offload_optimizer` / `offload_param` and the host budget."""
        zero = config.zero_optimization
        opt, par = zero.offload_optimizer, zero.offload_param
        sub = _sub_group_size(zero) if "sub_group_size" in zero.model_fields_set else None
        buffers = opt.buffer_count if opt is not None and "buffer_count" in opt.model_fields_set \
            else None
        own = config.zeromem
        in_backward = (zero.offload_optimizer_device == zero.offload_param_device == "nvme"
                       and not config.fp16.enabled and own.nvme_step_in_backward)
        return cls(WHERE[zero.offload_optimizer_device], WHERE[zero.offload_param_device],
                   _pin(opt), _pin(par), opt, par, sub, buffers, own.offload_host_budget_bytes,
                   "offload_host_budget_bytes" in own.model_fields_set, in_backward)

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


def _sub_group_size(zero: ZeroConfig) -> int:
    """The config's sub_group_size; its 0 (every parameter a sub-group of its own in
    DeepSpeed: the smallest tiles) is the smallest sub-group zeromem cuts, whose requests
    still keep a drive busy."""
    return int(zero.sub_group_size) or MIN_SUB_GROUP


def _pin(block: OffloadBlock | None) -> bool:
    return block is not None and bool(block.pin_memory) and torch.cuda.is_available()


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
        # file name -> [read, written] bytes of the last step (`end_step`), and since the start
        self.files_last_step: dict[str, list[int]] = {}
        self._files_mark: dict[str, list[int]] = {}

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
        files: dict[str, list[int]] = {}
        for space in self.spaces:
            for f in space.files:
                moved = files.setdefault(f.path.name, [0, 0])
                moved[0] += f.read_bytes
                moved[1] += f.written_bytes
        self.files_last_step = {name: [now - was for now, was in zip(
            moved, self._files_mark.get(name, [0, 0]))] for name, moved in files.items()}
        self._files_mark = files

    def io_report(self) -> dict[str, dict[str, Any]]:
        """{"last_step": ..., "total": ...}: read_bytes, written_bytes, wait_s (NVMe swap I/O);
        the last step's also by file ("files": name -> [read, written] bytes: grads.swp is
        neither written nor read back where the step ran in backward) and, with the
        optimizer on NVMe, its sub-groups stepped in the boundary backward ("in_backward")."""
        last: dict[str, Any] = {**vars(self.io_last_step), "files": dict(self.files_last_step)}
        overlapped = getattr(self.masters.optimizer, "overlapped", None)  # the NVMe optimizer's
        if overlapped is not None:
            last["in_backward"] = overlapped["in_backward"]
        return {"last_step": last, "total": vars(self.io_total())}

    def close(self) -> None:
        """Wait for I/O in flight (the step's writes behind, too) and remove the swap files."""
        try:
            self.masters.finish_io()
        except OffloadError as e:  # the files are removed anyway: nothing is lost that was kept
            log.error("NVMe offload I/O failed before close: %s", e)
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


def build_params(config: Config, shards: list[tuple[int, torch.dtype]], device: torch.device,
                 spaces: SwapSpaces) -> ParamPlacement:
    """The parameter placement, before the flat groups exist: `shards` (elements, dtype) are
    those the engine will build, in order; each is handed over (`admit`) once it is built."""
    policy = OffloadPolicy.from_config(config)
    if policy.params == "device":
        return ParamsOnDevice()
    block = policy.params_offload
    if policy.params == "host":
        return ParamsOnHost(block, policy.params_pin, device)
    try:
        # the step in backward writes the shards' other copy (offload/params_nvme.py)
        copies = 2 if policy.step_in_backward else 1
        return ParamsOnNvme(shards, device, spaces.for_block(block), block,
                            policy.params_pin, copies)
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


GradHome = HostGrads | GradFile | None  # where reduced gradients go (None: where reduced)


def build_grads(config: Config, groups: list[FlatParamGroup], sharding: Sharding,
                spaces: SwapSpaces, device: torch.device) -> GradHome:
    """Each group's gradient buffer (flat.py), built knowing where its reduced gradient goes
    (FSDP2's OffloadPolicy), which is returned for the masters placement (`build_offload`):

    - None: it stays where it is reduced (no optimizer offload);
    - `HostGrads`: copied into an fp32 host buffer after the boundary reduction, the copy
      overlapping the rest of backward (the optimizer on the host; on NVMe below stage 2);
    - `GradFile`: written to grads.swp as reduced (the optimizer on NVMe, stages 2-3).
    """
    dtype = config.grad_dtype
    home = _grad_home(OffloadPolicy.from_config(config), groups, sharding, spaces, dtype)
    host = home if isinstance(home, HostGrads) else None
    if sharding.grads:
        # contiguous_gradients: every group's reduced shard is a view into one buffer,
        # allocated when first read (never, where the shards go to grads.swp)
        shards = ContiguousShards([g.shard_numel for g in groups], dtype, device)
        for i, g in enumerate(groups):
            g.attach_grads(ShardToFile(g, dtype, device, home) if isinstance(home, GradFile)
                           else ShardAccumulated(g, shards, i, host))
    else:
        kind = WholeScattered if sharding.optimizer else WholeAllReduced
        for g in groups:
            g.attach_grads(kind(g, dtype, host))
    return home


def _grad_home(policy: OffloadPolicy, groups: list[FlatParamGroup], sharding: Sharding,
               spaces: SwapSpaces, accum_dtype: torch.dtype) -> GradHome:
    if policy.optimizer == "device":
        return None
    if policy.optimizer == "nvme" and sharding.grads and groups:
        try:
            return GradFile(groups, spaces.for_block(policy.optimizer_offload), accum_dtype)
        except BaseException:
            spaces.close()
            raise
    return HostGrads(policy.optimizer_pin)


def build_offload(config: Config, groups: list[FlatParamGroup], params: ParamPlacement,
                  spaces: SwapSpaces, rank: int, staged: StagedMasters | None = None,
                  grads: GradHome = None) -> Offload:
    """The masters placement the config asks for, beside the parameter placement the groups'
    shards were handed to (`build_params`), where the gradient buffers put the reduced
    gradients (`build_grads`) and, 16-bit, the masters written as they were built
    (`stage_masters`)."""
    policy = OffloadPolicy.from_config(config)
    if config.aio.use_gds and "nvme" in (policy.optimizer, policy.params):
        log.warning("aio.use_gds: GPUDirect Storage is not implemented; I/O goes through host "
                    "buffers")
    try:
        masters = _masters_placement(policy, groups, params, spaces, rank, staged, grads)
    except BaseException:
        spaces.close()
        raise
    if rank == 0 and policy.optimizer != "device":
        log.info("offload: optimizer on %s, parameters on %s%s", policy.optimizer, policy.params,
                 "".join(f"; swap files in {space.dir}" for space in spaces.all()))
    return Offload(policy, masters, params, spaces.all())


def _masters_placement(policy: OffloadPolicy, groups: list[FlatParamGroup],
                       params: ParamPlacement, spaces: SwapSpaces, rank: int,
                       staged: StagedMasters | None, grads: GradHome) -> MastersPlacement:
    if policy.optimizer == "device":
        return MastersOnDevice(groups, policy, params)
    if policy.optimizer_offload.ratio < 1:
        log.warning("offload_optimizer.ratio = %s: partial offload is not implemented; "
                    "all optimizer state is offloaded", policy.optimizer_offload.ratio)
    if grads is None:
        raise ConfigError("offload_optimizer: the gradient buffers were built without "
                          "offload (placement.build_grads, from the same config)")
    if policy.optimizer == "host":
        assert isinstance(grads, HostGrads)  # build_grads: host copies unless on NVMe
        return MastersOnHost(groups, policy, params, grads)
    return MastersOnNvme(groups, policy, spaces.for_block(policy.optimizer_offload), grads, rank,
                         staged)
