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
