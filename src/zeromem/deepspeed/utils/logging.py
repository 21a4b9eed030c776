"""DeepSpeed's `deepspeed.utils.logging`: the library's logger, and `log_dist`.

Lightning sets the level through `deepspeed.utils.logging.logger.setLevel(...)`;
DeepSpeed scripts log through `deepspeed.utils.logging.log_dist(message, ranks=[0])`.
Both reach zeromem's own `zeromem.deepspeed` logger.
"""
from __future__ import annotations

import logging

import torch.distributed as dist

logger = logging.getLogger("zeromem.deepspeed")


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the listed ranks (all of them when `ranks` is None or holds -1),
    prefixed with the rank, as DeepSpeed's `log_dist` does."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
