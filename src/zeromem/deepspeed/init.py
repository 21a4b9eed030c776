"""DeepSpeed's `init_distributed`: create the default process group if none exists."""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from ..distributed import LIFECYCLE, ensure_process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialise `torch.distributed` as DeepSpeed's `init_distributed` does.

    Launched by torchrun (RANK and WORLD_SIZE set): the default group from that
    environment (NCCL with CUDA, else gloo; `dist_backend` overrides), at `init_method`
    when given. Given `rank` and `world_size`: that group, at `init_method` or
    MASTER_ADDR/PORT. With neither: a world of one process, so a script also runs with
    plain `python`. MPI discovery is not done (`auto_mpi_discovery` is accepted). A group
    created here is zeromem's: `zeromem.shutdown()` ends it, also at exit.
    """
    if dist.is_initialized() or dist_init_required is False:
        return
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if rank < 0 and launched and init_method is None:
        ensure_process_group(timeout.total_seconds() if timeout is not None else None, dist_backend)
        return
    backend = dist_backend or "gloo"
    if rank < 0 and launched:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    elif rank < 0:  # no launcher: one process
        rank, world_size = 0, 1
        init_method = init_method or f"tcp://127.0.0.1:{_free_port()}"
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    LIFECYCLE.created_group()
