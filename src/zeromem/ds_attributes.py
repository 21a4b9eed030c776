"""DeepSpeed's attributes on a partitioned parameter, which libraries written for it read.

`ds_id`, `ds_shape`, `ds_numel` and `ds_status` (a `ZeroParamStatus`) on every stage-3
parameter and every parameter `zeromem.Init` partitioned: DeepSpeed-Chat's and
OpenRLHF's savers gather what carries `ds_id`, PEFT sizes its adapters from `ds_shape`.
`partition_numel()`: the elements of it this rank holds (Lightning's model summary).
Set here when a parameter is partitioned; `ds_status` is kept by whoever gathers and
releases it (flat.py's group transitions, Init's `Partitions`).
"""
from __future__ import annotations

import enum

import torch
from torch import nn


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's word for a stage-3 parameter's state, kept on each one as `ds_status`
    beside `ds_id`, `ds_shape` and `ds_numel`: code written for DeepSpeed (DeepSpeed-Chat's
    and OpenRLHF's model savers) gathers the parameters that carry `ds_id` and treats the
    others as whole, so without them it saved stage 3's empty parameters as they were."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class _Count:
    """`p.partition_numel()`, picklable (a lambda on a parameter would not save)."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __call__(self) -> int:
        return self.n


def mark_partitioned(p: nn.Parameter, shape: torch.Size, numel: int, held: int) -> None:
    """Give partitioned `p` DeepSpeed's names for it: `ds_id`, `ds_shape`, `ds_numel`, and
    `partition_numel()`, the elements of it this rank holds (Lightning's model summary
    counts those)."""
    p.ds_id, p.ds_shape, p.ds_numel = id(p), shape, numel  # type: ignore[attr-defined]
    p.partition_numel = _Count(held)  # type: ignore[attr-defined]
