"""Host and NVMe bytes of one rank under offload, named as the engine's ledger files them.

ZeRO-Offload (optimizer on the CPU) and ZeRO-Infinity (NVMe) move more than the
master weights and optimizer states off the device. Per element of the rank's shard:

    offload_optimizer: cpu    host masters (fp32, 4 B: a host copy even in fp32
                              training, the device keeps its parameter shard),
                              optimizer states (8 B for Adam, plus one scalar
                              `step` per flat group), host gradients (fp32, 4 B:
                              the reduced shard is copied there at the boundary)
    offload_optimizer: nvme   host gradients (fp32, 4 B); swap buffers: a pool of
                              buffer_count // (1 + states) sub-groups x (master +
                              states) fp32 buffers of the largest sub-group
                              (<= sub_group_size elements), 4 KiB aligned; on NVMe
                              the master (unless it aliases fp32 parameters) and
                              the states
    offload_param: cpu        parameter shards (parameter width)
    offload_param: nvme       a pool of buffer_count buffers of the largest
                              parameter shard, 4 KiB aligned; the shards on NVMe

(`offload/placement.py`, `offload/nvme_optimizer.py`, `offload/params.py`.)
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN_BYTES = 4096  # swap buffers are aligned for O_DIRECT (offload/nvme.py)
FP32 = 4


@dataclass(frozen=True)
class OffloadKnobs:
    """The config keys that size swap buffers (DeepSpeed's defaults)."""

    sub_group_size: int = 1_000_000_000
    optimizer_buffer_count: int = 4
    param_buffer_count: int = 5


def _aligned(nbytes: float) -> float:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _largest_sub_group(shards: list[float], sub_group_size: int) -> float:
    """Elements of the largest sub-group when the shards are cut as `plan_sub_groups` cuts."""
    largest, current = 0.0, 0.0
    for numel in shards:
        left = numel
        while left > 0:
            if current == sub_group_size:
                current = 0.0
            take = min(left, sub_group_size - current)
            current += take
            left -= take
            largest = max(largest, current)
    return largest


def offload_breakdown(shards: list[float], optimizer: str, param: str, param_bytes: int,
                      state_bytes: int, scalar_bytes: float, fp32_params: bool,
                      knobs: OffloadKnobs = OffloadKnobs()) -> tuple[dict[str, float],
                                                                      dict[str, float]]:
    """(host, nvme) bytes by name for a rank whose flat groups have `shards` elements each.

    `state_bytes`: optimizer state bytes per element (8 for Adam); `scalar_bytes`: the
    per-group scalars in all; `fp32_params`: the master aliases the parameters on NVMe.
    """
    shard = sum(shards)
    host: dict[str, float] = {}
    nvme: dict[str, float] = {}
    if optimizer == "cpu":
        host["host_masters"] = FP32 * shard
        host["optimizer_states"] = state_bytes * shard + scalar_bytes
        host["host_grads"] = FP32 * shard
    elif optimizer == "nvme":
        fields = state_bytes // FP32
        depth = max(1, knobs.optimizer_buffer_count // (1 + fields))
        slot = _aligned(FP32 * _largest_sub_group(shards, knobs.sub_group_size))
        host["host_grads"] = FP32 * shard
        host["optimizer_swap_buffers"] = depth * (1 + fields) * slot
        nvme["optimizer_states"] = state_bytes * shard
        if not fp32_params:
            nvme["masters"] = FP32 * shard
    if param == "cpu":
        host["param_shards"] = param_bytes * shard
    elif param == "nvme":
        host["param_swap_buffers"] = knobs.param_buffer_count * _aligned(
            param_bytes * max(shards, default=0))
        nvme["param_shards"] = sum(_aligned(param_bytes * n) for n in shards)  # one slot each
    return host, nvme
