"""DeepSpeed's `deepspeed.runtime.utils.see_memory_usage`, which training scripts call
between phases ("after initialize", "after step"): registered under that name by
`install_as_deepspeed`.
"""
from __future__ import annotations

import gc
import logging
import resource

import torch.distributed as dist

from .accelerator import get_accelerator

log = logging.getLogger("zeromem.deepspeed")

GIB = 2 ** 30


def host_resident_bytes() -> int:
    """This process's resident host memory (Linux `/proc/self/statm`; else its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log `message` with the accelerator's allocated and peak memory and this process's
    resident host memory, on rank 0, when `force` (as DeepSpeed: silent otherwise); the
    peak is reset for the next call."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()  # freed Python objects give their memory back before it is read
    accelerator = get_accelerator()
    log.info("%s | allocated %.2f GiB, peak %.2f GiB (%s) | host resident %.2f GiB", message,
             accelerator.memory_allocated() / GIB, accelerator.max_memory_allocated() / GIB,
             accelerator.device_name(), host_resident_bytes() / GIB)
    accelerator.reset_peak_memory_stats()
