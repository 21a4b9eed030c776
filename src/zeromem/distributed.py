"""Creating the default process group from torchrun's environment when none exists."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def ensure_process_group(timeout_s: float | None = None) -> None:
    """Initialise the default group (NCCL with CUDA, else gloo) if torchrun launched us.

    Without torchrun's variables and without a group, nothing is created: zeromem
    then runs as world size 1. `ZEROMEM_TIMEOUT_S` bounds how long a collective
    waits for a rank that died or diverged (default 600 s).
    """
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    timeout = timedelta(seconds=timeout_s or float(os.environ.get("ZEROMEM_TIMEOUT_S", 600)))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def gather_timeout_s() -> float | None:
    """Seconds a stage-3 gather may wait before the ranks count as diverged.

    `ZEROMEM_GATHER_TIMEOUT_S` (default 300). A rank that runs a forward the others
    do not (evaluation on rank 0 only) then fails with a message naming the module
    and the ranks that did not follow, instead of hanging.
    """
    value = float(os.environ.get("ZEROMEM_GATHER_TIMEOUT_S", 300))
    return value if value > 0 else None


def default_store():
    """The default process group's key-value store, or None (used only for diagnostics)."""
    if not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except (ImportError, RuntimeError):
        return None
