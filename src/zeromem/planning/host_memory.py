"""Host and NVMe bytes of one rank under offload, named as the engine's ledger files them.

ZeRO-Offload (optimizer on the CPU) and ZeRO-Infinity (NVMe) move more than the
master weights and optimizer states off the device. Per element of the rank's shard:

    offload_optimizer: cpu    host masters (fp32, 4 B: a host copy even in fp32
                              training, the device keeps its parameter shard),
                              optimizer states (8 B for Adam, plus one scalar
                              `step` per flat group), host gradients (fp32, 4 B:
                              the reduced shard is copied there at the boundary)
    offload_optimizer: nvme   the optimizer pool (sub-groups in flight x master,
                              states and, at stage 2/3, gradient buffers), sized
                              from the host budget `zeromem.offload_host_budget_bytes`;
                              host gradients (fp32, 4 B) at stage 1 only: at stage
                              2/3 the reduced shards go to grads.swp; on NVMe the
                              states, the master (unless it is the fp32 parameter
                              shard) and, at stage 2/3, the gradients
                              On a CPU device in fp32 the reduced gradient shard
                              already is an fp32 host tensor: the engine reads it
                              where it is (`offload/masters.py` `HostGrads`), so it is
                              held once, and the planner files the device's gradient
                              as the host gradient (`grads_shared`), as the ledger does
    offload_param: cpu        parameter shards (parameter width; on a CPU device the
                              shard itself, gathered from where it is: no copy)
    offload_param: nvme       a pool of buffer_count buffers, shard i read into
                              buffer i % buffer_count, each the size of the largest
                              shard it serves; the shards on NVMe, one aligned slot each

Every size comes from the engine's own layout code (`offload/sub_groups.py`
`layout_optimizer`, `offload/budget.py`, `offload/params_nvme.py` `ShardBuffers.pool_nbytes`,
`offload/grad_file.py` `record_bytes`) applied to the planner's shard sizes, so the
prediction cannot drift from what the engine allocates.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeromem.config.schema import OFFLOAD_HOST_BUDGET_BYTES, Config, OffloadParamConfig
from zeromem.offload.budget import DEPTH, MIN_SUB_GROUP
from zeromem.offload.grad_file import record_bytes
from zeromem.offload.masters import reduced_is_host_grad
from zeromem.offload.nvme import round_up, swap_file_bytes
from zeromem.offload.params_nvme import ShardBuffers
from zeromem.offload.sub_groups import ShardSpec, layout_optimizer
from zeromem.offload.placement import OffloadPolicy

FP32 = 4


@dataclass(frozen=True)
class OffloadBufferSizes:
    """The config keys that size swap buffers; None: derived from the host budget."""

    sub_group_size: int | None = None  # zero_optimization.sub_group_size, when set
    optimizer_buffer_count: int | None = None  # offload_optimizer.buffer_count, when set
    param_buffer_count: int = OffloadParamConfig.model_fields["buffer_count"].default
    host_budget_bytes: int = OFFLOAD_HOST_BUDGET_BYTES
    # the step may begin in backward (not fp16): optimizer.swp and params.swp hold two copies
    step_in_backward: bool = False

    @classmethod
    def from_config(cls, config: Config) -> OffloadBufferSizes:
        """The sizes as the engine reads them (`OffloadPolicy.from_config`)."""
        policy = OffloadPolicy.from_config(config)
        params = policy.params_block
        return cls(policy.sub_group_size, policy.optimizer_buffers,
                   params.buffer_count if params is not None else cls.param_buffer_count,
                   policy.host_budget_bytes, policy.step_in_backward)


def grads_shared(device: str, grad_bytes: int, master_bytes: int = FP32) -> bool:
    """The host gradient is the device's reduced gradient itself (no copy) for ranks that
    compute on `device` ("cuda", "cpu") with `grad_bytes`-wide gradients beside
    `master_bytes`-wide masters: the engine's own test (`HostGrads` asks
    `reduced_is_host_grad`); any 16-bit dtype answers as bf16."""
    def dtype(nbytes: int) -> torch.dtype:
        return torch.float32 if nbytes == FP32 else torch.bfloat16
    return reduced_is_host_grad(torch.device(device), dtype(grad_bytes), dtype(master_bytes))


def _params_pool(numels: list[int], param: str, param_bytes: int, buffers: OffloadBufferSizes) -> int:
    """Host bytes of the NVMe parameter pool (`ParamsOnNvme`), as its `ShardBuffers` sizes it
    from the shards in admit order."""
    if param != "nvme":
        return 0
    return ShardBuffers.pool_nbytes([param_bytes * n for n in numels], buffers.param_buffer_count)


def least_budget(shards: list[float], param: str, param_bytes: int, state_bytes: float,
                 grads_in_file: bool, buffers: OffloadBufferSizes = OffloadBufferSizes()) -> int:
    """The smallest `zeromem.offload_host_budget_bytes` whose sub-groups keep MIN_SUB_GROUP
    elements (1 MiB requests, `offload/budget.py`): the parameter pool plus DEPTH
    sub-groups of master, states and (stage 2/3) gradient fields. NVMe offload is the
    answer when host memory is short, so the planner gives it this much and no more."""
    fields = 1 + int(state_bytes) // FP32 + int(grads_in_file)
    numels = [int(n) for n in shards]
    return _params_pool(numels, param, param_bytes, buffers) + DEPTH * fields * FP32 * MIN_SUB_GROUP


def offload_breakdown(shards: list[float], optimizer: str, param: str, param_bytes: int,
                      state_bytes: float, scalar_bytes: float, fp32_params: bool,
                      buffers: OffloadBufferSizes = OffloadBufferSizes(),
                      grads_in_file: bool = True, frozen: Sequence[float] = (),
                      master_bytes: int = FP32) -> tuple[dict[str, float], dict[str, float]]:
    """(host, nvme) bytes by name for a rank whose flat groups have `shards` elements each
    (and stage 3's groups of frozen parameters `frozen`: parameter shards only).

    `state_bytes`: optimizer state bytes per element (8 for Adam); `scalar_bytes`: the
    per-group scalars in all; `fp32_params`: the master aliases the parameters;
    `master_bytes`: the width of the host masters and gradients (fp32; bf16 masters: 2);
    `grads_in_file`: gradients are reduced every micro-step (stage 2/3), so with the
    optimizer on NVMe they go to grads.swp.
    """
    shard = sum(shards)
    numels = [int(n) for n in shards]
    host: dict[str, float] = {}
    nvme: dict[str, float] = {}
    kept = [int(n) for n in frozen]  # placed with the others, never stepped
    params_pool = _params_pool(numels + kept, param, param_bytes, buffers)
    # offload/backward_step.py: both on NVMe, gradients through grads.swp (no fp16: the policy)
    copies = 2 if (buffers.step_in_backward and grads_in_file
                   and optimizer == param == "nvme") else 1
    if param == "cpu":
        host["param_shards"] = param_bytes * (shard + sum(frozen))
    elif param == "nvme":
        host["param_swap_buffers"] = params_pool
        # a record each, in every copy (a frozen group uses the first only)
        nvme["param_shards"] = copies * sum(round_up(param_bytes * n) for n in numels + kept)
    if optimizer == "cpu":
        host["host_masters"] = master_bytes * shard
        host["optimizer_states"] = state_bytes * shard + scalar_bytes
        host["host_grads"] = master_bytes * shard
    elif optimizer == "nvme":
        layout = layout_optimizer([ShardSpec(0, n) for n in numels], int(state_bytes) // FP32,
                                  not fp32_params, grads_in_file, buffers.host_budget_bytes,
                                  params_pool, buffers.sub_group_size, buffers.optimizer_buffer_count)
        host["optimizer_swap_buffers"] = layout.pool_nbytes
        nvme["optimizer_states"] = swap_file_bytes(copies * layout.file_bytes) - layout.master_nbytes
        if layout.master_nbytes:
            nvme["masters"] = layout.master_nbytes
        if grads_in_file:
            nvme["grads"] = swap_file_bytes(sum(record_bytes(n) for n in numels))
        else:
            host["host_grads"] = FP32 * shard
    return host, nvme
