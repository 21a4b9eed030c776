"""Checking, at `initialize`, that every rank was given the same config and model.

Ranks built from different configs or models do not fail by themselves: they
hang until the collective timeout, die in a gloo abort with no Python error, or
(bf16 against fp16, a different lr or clipping) train silently wrong. So each
rank publishes a digest of its resolved config and of its parameters' names,
shapes, dtypes and `requires_grad` in one `all_gather_object`; only when the
digests differ are the details exchanged, and every rank raises the same error
naming the keys or parameters and the ranks' values.
"""
from __future__ import annotations

import hashlib
import json

import torch.distributed as dist
from torch import nn

from zeromem.comm import Comm
from zeromem.config.schema import Config, ConfigError
from zeromem.stage3.partitioned_init import Partitions

SHOWN = 8  # differing keys / parameters listed in the message
# Keys that may differ by rank without changing the numbers: each node (or rank) may
# name its own local disk for swap files.
LOCAL_KEYS = ("zero_optimization.offload_optimizer.nvme_path",
              "zero_optimization.offload_param.nvme_path")


class RankMismatchError(ConfigError):
    """Ranks were started with different configs or different models."""


def config_items(config: Config) -> dict[str, str]:
    """The resolved config as dotted key -> JSON value text."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = json.dumps(value, sort_keys=True, default=str)

    walk("", config.model_dump())
    for key in LOCAL_KEYS:
        flat.pop(key, None)
    return flat


def model_items(module: nn.Module, partitions: Partitions) -> dict[str, str]:
    """Parameter name -> 'shape dtype requires_grad' (whole shapes for Init-built ones)."""
    items = {}
    for name, p in module.named_parameters():
        shape = partitions.full_shape(p)
        items[name] = f"{tuple(shape)} {p.dtype} requires_grad={p.requires_grad}"
    return items


def _digest(items: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(items.items())).encode()).hexdigest()


def check_ranks_agree(config: Config, module: nn.Module, comm: Comm,
                      partitions: Partitions) -> None:
    """Raise RankMismatchError on every rank if any two ranks differ in config or model.

    `partitions` knows the whole shapes of parameters built under `Init`."""
    if comm.world_size == 1:
        return
    mine = (config_items(config), model_items(module, partitions))
    digests: list[object] = [None] * comm.world_size
    dist.all_gather_object(digests, (_digest(mine[0]), _digest(mine[1])), group=comm.group)
    if all(d == digests[0] for d in digests):
        return
    details: list[tuple[dict[str, str], dict[str, str]]] = [({}, {})] * comm.world_size
    dist.all_gather_object(details, mine, group=comm.group)  # only on a mismatch: every rank
    problems = _differences("config key", [d[0] for d in details]) + \
        _differences("parameter", [d[1] for d in details])
    raise RankMismatchError(
        f"ranks were started with different configs or models (seen on rank {comm.rank}): "
        + "; ".join(problems[:SHOWN]) + (f"; and {len(problems) - SHOWN} more"
                                          if len(problems) > SHOWN else ""))


def _differences(what: str, per_rank: list[dict[str, str]]) -> list[str]:
    """'<what> <name>: rank 0 = v, rank 1 = w' for each name whose value differs."""
    names = sorted(set().union(*per_rank))
    out = []
    for name in names:
        values = [items.get(name, "<absent>") for items in per_rank]
        if len(set(values)) > 1:
            out.append(f"{what} {name!r}: " + ", ".join(
                f"rank {r} = {v}" for r, v in enumerate(values)))
    return out
