"""DeepSpeed's `deepspeed.comm`: process-group queries and collectives for user scripts.

A thin facade over `torch.distributed` for the calls training scripts make
themselves (ranks, barriers, reducing a metric). zeromem's own collectives go
through `zeromem.comm.Comm`, which counts their bytes; these do not. Without a
process group, ranks are 0 and world sizes 1, so scripts also run as one process.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .init import init_distributed

__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank",
           "get_world_size", "get_local_rank", "get_global_rank", "get_backend", "barrier",
           "all_reduce", "broadcast", "broadcast_object", "all_gather", "all_gather_into_tensor", "reduce",
           "new_group", "destroy_process_group", "log_summary"]


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_backend(group=None) -> str | None:
    return dist.get_backend(group) if dist.is_initialized() else None


def barrier(group=None, async_op: bool = False, device_ids=None):
    if dist.is_initialized():
        return dist.barrier(group, async_op=async_op, device_ids=device_ids)
    return None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if dist.is_initialized():
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return None


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    if dist.is_initialized():
        return dist.broadcast(tensor, src, group=group, async_op=async_op)
    return None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False):
    if dist.is_initialized():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None,
                           async_op: bool = False):
    if dist.is_initialized():
        return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if dist.is_initialized():
        return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)
    return None


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """`src`'s picklable `obj` on every rank (the object itself without a process group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src) if group else src,
                               group=group)
    return box[0]


def new_group(ranks=None, **kwargs):
    return dist.new_group(ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group(group)


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed's `log_summary`: the `comms_logger` table of the newest engine's collectives,
    printed on rank 0 (`return_dict`: the table as a dict instead). Needs `comms_logger`
    enabled in the config."""
    from zeromem.distributed import LIFECYCLE

    if show_straggler:
        raise NotImplementedError("log_summary(show_straggler=True) is not supported: zeromem's "
                                  "comms log is per rank (each rank can print its own table)")
    logs = [engine.comm.log for engine in LIFECYCLE.engines if engine.comm.log is not None]
    if not logs:
        raise RuntimeError('log_summary: no engine records its collectives; set "comms_logger": '
                           '{"enabled": true} in the config')
    if return_dict:
        return logs[-1].table()
    if get_rank() == 0:
        print(logs[-1].summary())
    return None
