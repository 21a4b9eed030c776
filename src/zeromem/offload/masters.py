"""Where the fp32 master shard and the optimizer states live, and the step phases there.

One placement per run, chosen by `placement.build_offload` from the `OffloadPolicy`:
`MastersOnDevice` (no offload), `MastersOnHost` (ZeRO-Offload: the step on the CPU,
gradients copied to host buffers as their reductions finish, `HostGrads`) or
`MastersOnNvme` (ZeRO-Infinity: masters and states in a swap file, stepped sub-group
by sub-group, offload/nvme_optimizer.py). Each answers the same
`MastersPlacement` protocol, which the ZeRO optimizer's step phases call.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from zeromem.config.schema import ConfigError, OptimizerConfig
from zeromem.flat import FlatParamGroup
from zeromem.layout import BUCKETS_ALIVE
from zeromem.optim.factory import OPTIMIZERS, build_optimizer, has_fused_kernel
from zeromem.optim.optimizers import Lamb
from zeromem.offload.params import ParamPlacement, host_empty
from zeromem.offload.grad_file import GradFile
from zeromem.offload.nvme import OffloadError, SwapSpace
from zeromem.offload.nvme_optimizer import SwappedOptimizer
from zeromem.offload.staged_masters import StagedMasters

if TYPE_CHECKING:  # placement.py builds these from the policy
    from zeromem.offload.placement import OffloadPolicy

log = logging.getLogger("zeromem")

CPU_KERNEL = "fused"  # torch's fastest CPU optimizer kernel (benchmarks/bench_offload.py)


def reduced_is_host_grad(device: torch.device, dtype: torch.dtype,
                         master_dtype: torch.dtype = torch.float32) -> bool:
    """A reduced gradient of `dtype` on `device` already is a host tensor in the masters'
    dtype (the CPU is the device; fp32 gradients, or bf16 beside bf16 masters): `HostGrads`
    reads it where it is, so host and device hold it once. The planner asks the same
    (planning/host_memory.py `grads_shared`)."""
    return device.type == "cpu" and dtype == master_dtype


class HostGrads:
    """Host buffers the reduced gradient shards are copied into at the boundary, in the
    masters' dtype (fp32; bf16 under bf16.bf16_master_weights_and_grads).

    Given to each gradient buffer when it is built (flat.py `HostCopies`): the buffer asks
    for its host buffer (`buffer_for`) and copies its reduced shard there after each
    boundary reduction. Where the reduced shard already is such a host tensor (the CPU is
    the device), it is used as it is: a copy would hold the gradient twice in the same
    memory.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict[int, torch.Tensor] = {}
        self.boundary = False  # does the backward now running end a step (`start_backward`)
        self.cuda = False  # a copy came from a GPU: the step waits for it (`sync`)

    def buffer_for(self, group: FlatParamGroup, reduced: torch.Tensor) -> torch.Tensor | None:
        """`group`'s host buffer; None where `reduced` already is one (it is read as it is)."""
        self.cuda = self.cuda or group.param_shard.is_cuda
        dtype = group.master.dtype
        if reduced_is_host_grad(reduced.device, reduced.dtype, dtype) \
                and reduced.numel() == group.shard_numel:
            self.buffers[id(group)] = reduced
            return None
        self.buffers[id(group)] = host_empty(group.shard_numel, dtype, self.pin).zero_()
        return self.buffers[id(group)]

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
    buckets_alive: int  # full-size gradient buckets alive at once (Comm.schedule_reductions)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer `build_optimizer` made; None before."""

    def start_backward(self, boundary: bool) -> None:
        """The backward about to run ends a step (`boundary`) or accumulates."""

    def allow_step_in_backward(self, allowed: bool, keep_gradients: bool) -> None:
        """Nothing needs the whole gradient before the update (no loss scale, and a clip
        coefficient of 1 expected): the step may begin in the boundary backward where the
        placement can (NVMe); `keep_gradients`: it is a guess, redone from them if wrong."""

    def skip_step(self) -> None:
        """The step is skipped (a non-finite norm): whatever it began is undone."""

    def build_optimizer(self, config: OptimizerConfig | None, param_groups: list[dict],
                        factory: Callable | None,
                        params: ParamPlacement, device: torch.device) -> torch.optim.Optimizer:
        """The optimizer over the master shards (see optimizer_factory.build_optimizer); `device` is the
        engine's, where collectives run."""

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        """Step phase 3: the masters' gradients = reduced gradients x multiplier, in fp32."""

    def write_back(self, groups: list[FlatParamGroup], params: ParamPlacement) -> None:
        """Step phase 5: updated masters into the parameter shards, wherever those live."""

    def gradient(self, group: FlatParamGroup) -> torch.Tensor:
        """The group's reduced gradient shard, loss-scaled, where the step will read it
        (param_states.py reads and writes it between the boundary backward and the step)."""

    def refresh(self, groups: list[FlatParamGroup], params: ParamPlacement) -> None:
        """The masters changed outside a step (a checkpoint loaded): all of them into the
        parameter shards."""

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        """Every master and optimizer state in memory inside the block."""

    def finish_io(self) -> None:
        """Wait for swap I/O the step left in flight (before the files are removed)."""

    def file_into(self, ledger) -> None:
        """File this placement's host and NVMe tensors in the memory ledger."""


class MastersOnDevice:
    """No `offload_optimizer`: masters and states beside the parameters; torch's own step.

    With the parameter shards on the device too, the step calls none of this: its phases
    are the groups' own transitions (zero_optimizer.py). Here for the optimizer, and for
    stage 3 with `offload_param` (masters kept on the device, shards stored elsewhere)."""

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

    def allow_step_in_backward(self, allowed: bool, keep_gradients: bool) -> None:
        """The step needs the optimizer's own."""

    def skip_step(self) -> None:
        """Nothing began before the step."""

    def build_optimizer(self, config: OptimizerConfig | None, param_groups: list[dict],
                        factory: Callable | None,
                        params: ParamPlacement, device: torch.device) -> torch.optim.Optimizer:
        self.optimizer = build_optimizer(config, self.groups, param_groups, factory, device)
        return self.optimizer

    def unscale_grads(self, groups: list[FlatParamGroup], multiplier: float) -> None:
        for g in groups:
            g.unscale_into_master(multiplier)  # the group's own tensors

    def gradient(self, group: FlatParamGroup) -> torch.Tensor:
        return group.reduced_grad()

    def write_back(self, groups: list[FlatParamGroup], params: ParamPlacement) -> None:
        _store_masters(groups, params)

    refresh = write_back

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_io(self) -> None:
        """No swap files."""

    def file_into(self, ledger) -> None:
        """The engine files device tensors itself."""


class MastersOnHost:
    """`offload_optimizer.device: cpu`: masters, states and gradients in host memory (fp32;
    bf16 under bf16.bf16_master_weights_and_grads)."""

    where = "host"
    buckets_alive = BUCKETS_ALIVE

    def __init__(self, groups: list[FlatParamGroup], policy: OffloadPolicy,
                 params: ParamPlacement, host_grads: HostGrads):
        self.groups = groups
        self.optimizer: torch.optim.Optimizer | None = None
        self.host_grads = host_grads  # the gradient buffers copy into it (placement.build_grads)
        for g in groups:  # its own host tensor even where the master was the parameter
            # shard (compute in the masters' dtype): the device keeps the shard
            master = host_empty(g.shard_numel, g.master.dtype, policy.optimizer_pin)
            if g.master_aliases_params():  # the values are where the shard is
                params.load(g, 0, master)
            else:
                master.copy_(g.master)
            g.place_master(master)

    def start_backward(self, boundary: bool) -> None:
        self.host_grads.boundary = boundary

    def allow_step_in_backward(self, allowed: bool, keep_gradients: bool) -> None:
        """The step needs the optimizer's own."""

    def skip_step(self) -> None:
        """Nothing began before the step."""

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

    def gradient(self, group: FlatParamGroup) -> torch.Tensor:
        """The host copy: the step reads it, not the device shard it was copied from."""
        self.host_grads.sync()
        return self.host_grads.buffers[id(group)]

    def write_back(self, groups: list[FlatParamGroup], params: ParamPlacement) -> None:
        _store_masters(groups, params)

    refresh = write_back

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # host memory is memory

    def finish_io(self) -> None:
        """No swap files."""

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
                 grads: HostGrads | GradFile, rank: int = 0, staged: StagedMasters | None = None):
        """Masters stay until SwappedOptimizer writes them to its file (fp32: they are shards),
        in `staged`'s file when `initialize` wrote them there as it built the groups.

        Where the gradient buffers put the reduced gradients (`grads`, placement.build_grads):
        reduced every micro-step (stage 2/3), they go to a swap file as reduced
        (offload/grad_file.py), so no gradient shard stays in memory; stage 1's whole
        gradient is on the device anyway, and its shard is copied to host (`HostGrads`).
        """
        self.groups, self.policy, self.space, self.rank = groups, policy, space, rank
        self.staged = staged  # handed to the optimizer, which copies and removes it
        self.optimizer: SwappedOptimizer | None = None
        self.host_grads = grads if isinstance(grads, HostGrads) else None
        self.grad_file = grads if isinstance(grads, GradFile) else None
        self.buckets_alive = BUCKETS_ALIVE
        if self.grad_file is not None:
            # each bucket is a whole unit in host memory (and a reducing one gloo's receive
            # buffer and its reduced shard too): two, one reducing while the next unit's
            # gradients fill the other, keep backward's peak to two units' gradient paths
            # (the default's third would hold one more, about 0.07x of the model states
            # more at W=2048) while the reduction, its store and the step of its
            # sub-groups overlap the next unit's backward instead of holding it up
            # (one at a time: the next unit's first gradient waited for them, 1.27x the
            # bound at W=2048, 1.3x at W=1024)
            self.buckets_alive = 2

    def start_backward(self, boundary: bool) -> None:
        """At the boundary, the step's first reads start: they overlap this backward."""
        if self.host_grads is not None:
            self.host_grads.boundary = boundary
        if boundary and self.optimizer is not None:
            self.optimizer.read_before_step()  # or the step begins, where allowed

    def allow_step_in_backward(self, allowed: bool, keep_gradients: bool) -> None:
        if self.optimizer is not None:
            self.optimizer.allow_step_in_backward(allowed, keep_gradients)

    def skip_step(self) -> None:
        self._built().discard()

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

    def gradient(self, group: FlatParamGroup) -> torch.Tensor:
        raise OffloadError("with offload_optimizer nvme the reduced gradients go to grads.swp "
                           "as they are reduced (or the step takes them in backward), so no "
                           "whole gradient shard is held to read; offload to \"cpu\" to read it")

    def refresh(self, groups: list[FlatParamGroup], params: ParamPlacement) -> None:
        """16-bit: the masters live in optimizer.swp, apart from the shards, and no step
        stored these; read whole (as the load just did) and stored."""
        with self.all_in_memory():
            _store_masters(groups, params)

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        return self._built().all_in_memory(self.groups)

    def finish_io(self) -> None:
        if self.optimizer is not None:
            self.optimizer.settle()

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
