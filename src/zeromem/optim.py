"""Building the torch optimizer over the engine's fp32 master shards.

The user's param groups (torch style, each with its own lr / weight_decay) map to
flat groups; the optimizer sees one master tensor per flat group, grouped back
into the user's param groups so per-group options keep their meaning.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch
from torch import nn

from zeromem.config.schema import ConfigError

log = logging.getLogger("zeromem")

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def normalize_param_groups(module: nn.Module, model_parameters: Iterable | None) -> list[dict]:
    """Torch-style param groups of trainable parameters, each parameter once.

    Parameters of `module` that no group names, or that do not require grad, are
    frozen: they get no optimizer state, no gradient buffer and no communication.
    """
    given: list = list(model_parameters) if model_parameters is not None else list(module.parameters())
    raw: list[dict] = given if given and isinstance(given[0], dict) else [{"params": given}]
    seen: set[int] = set()
    groups = []
    for group in raw:
        params = []
        for p in group["params"]:
            if id(p) in seen or not p.requires_grad:
                continue  # a tied weight listed twice is one parameter
            seen.add(id(p))
            params.append(p)
        groups.append({**group, "params": params})
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            log.info("parameter %s is in no param group: treated as frozen", name)
            p.requires_grad_(False)
    return [g for g in groups if g["params"]]


def build_optimizer(config, flat_groups: list, param_groups: list[dict],
                    factory: Callable[[list[dict]], torch.optim.Optimizer] | None
                    ) -> torch.optim.Optimizer:
    """The optimizer over master shards: from `factory` or from the config's `optimizer` block."""
    groups = []
    for gi, pg in enumerate(param_groups):
        options = {k: v for k, v in pg.items() if k != "params"}
        masters = [g.master for g in flat_groups if g.param_group_index == gi]
        groups.append({"params": masters, **options})
    if factory is not None:
        return factory(groups)
    if config is None:
        raise ConfigError("no optimizer: give an 'optimizer' block in the config or an optimizer "
                          "factory to zeromem.initialize")
    cls = OPTIMIZERS[config.type.lower()]
    params = dict(config.params)
    if cls is not torch.optim.SGD and not {"foreach", "fused"} & set(params):
        # One fused kernel over each master shard: ~7x torch's default per-tensor loop on CPU.
        params["fused"] = True
    return cls(groups, **params)


def optimizer_state_bytes_per_param(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state per parameter the paper's K counts besides the fp32 master."""
    defaults = optimizer.defaults
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 12 if defaults.get("amsgrad") else 8
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if defaults.get("momentum") else 0
    return 8
