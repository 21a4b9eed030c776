"""What every rank of a checkpoint agrees on: a step that failed on one rank fails on all,
together (no rank waits in a collective for a peer that already raised), rows of integers
shared by all ranks, and the tag (`checkpoint.tag_validation`). Each runs one collective
over the shards' `Comm` (ledger kind "checkpoint").
"""
from __future__ import annotations

import hashlib
import logging
from typing import Callable, TypeVar, cast

import torch
import torch.distributed as dist

from zeromem.checkpoints.tensor_files import CheckpointError
from zeromem.training_state import TrainingState

log = logging.getLogger("zeromem")

T = TypeVar("T")


def all_ranks_ok(state: TrainingState, error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed `what`; all raise together if one did."""
    comm = state.comm
    flags = torch.zeros(comm.world_size, dtype=torch.int64, device=state.device)
    flags[comm.rank] = int(error is not None)
    comm.all_reduce(flags, op=dist.ReduceOp.MAX, kind="checkpoint")
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"{what} failed on rank {comm.rank}: {error}") from error
    raise CheckpointError(f"{what} failed on rank(s) {failed}; see their error")


def attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """(`fn()`, None), or (None, the error it raised) to be shared by `all_ranks_ok`."""
    try:
        return fn(), None
    except Exception as error:  # shared with every rank by all_ranks_ok, then re-raised
        return None, error


def collective(state: TrainingState, what: str, fn: Callable[[], T]) -> T:
    """`fn()` on every rank; if it raised on any, every rank raises (naming `what`)."""
    result, error = attempt(fn)
    all_ranks_ok(state, error, what)
    return cast(T, result)  # `fn` returned: all_ranks_ok raised otherwise


def share_rows(state: TrainingState, row: list[int]) -> list[list[int]]:
    """All ranks' equal-length integer rows (an all-gather done as an all-reduce)."""
    comm = state.comm
    table = torch.zeros(comm.world_size, len(row), dtype=torch.int64, device=state.device)
    table[comm.rank] = torch.tensor(row, dtype=torch.int64)
    comm.all_reduce(table, kind="checkpoint")
    return table.tolist()


def check_same_tag(state: TrainingState, tag: str) -> None:
    """checkpoint.tag_validation: ranks must agree on the tag (Warn / Fail / Ignore)."""
    mode = state.tag_validation
    if mode == "Ignore" or state.comm.world_size == 1:
        return
    h = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "little")
    hashes = {row[0] for row in share_rows(state, [h])}
    if len(hashes) > 1:
        message = f"checkpoint tag {tag!r} differs between ranks"
        if mode == "Fail":
            raise CheckpointError(message)
        log.warning(message)
