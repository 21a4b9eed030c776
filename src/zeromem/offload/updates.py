"""The update a swapped optimizer runs on one sub-group (ZeRO-Infinity, arXiv 2104.07857, 5).

The NVMe optimizer (offload/nvme_optimizer.py) steps its shard sub-group by sub-group,
on views of pool buffers: it cannot hand torch.optim its tensors, so it calls the
functional kernels behind torch.optim (fused CPU kernels) with the template optimizer's
hyperparameters. This module says which optimizers that covers, which state fields each
keeps on disk, and runs one update; the step counter is the caller's (steps taken so far).
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from zeromem.offload.nvme import OffloadError

_adam = importlib.import_module("torch.optim.adam")  # the functional kernels behind torch.optim
_sgd = importlib.import_module("torch.optim.sgd")


def state_fields(template: torch.optim.Optimizer) -> tuple[str, ...]:
    """The state tensors `template`'s update keeps per parameter (each a field on disk);
    an optimizer this module cannot step is refused here, when the optimizer is built."""
    groups = template.param_groups
    if isinstance(template, (torch.optim.Adam, torch.optim.AdamW)):
        return ("exp_avg", "exp_avg_sq") + (
            ("max_exp_avg_sq",) if any(g["amsgrad"] for g in groups) else ())
    if isinstance(template, torch.optim.SGD):
        return ("momentum_buffer",) if any(g["momentum"] for g in groups) else ()
    raise OffloadError(f"NVMe optimizer offload steps Adam, AdamW or SGD, not "
                       f"{type(template).__name__}")


def adam_update(group: dict, params: list, grads: list, states: dict, step: int) -> None:
    """torch's functional Adam/AdamW (fused CPU kernel) on views; `step` = steps taken so far."""
    _adam.adam(params, grads, states["exp_avg"], states["exp_avg_sq"],
               states["max_exp_avg_sq"] if group["amsgrad"] else [],
               [torch.tensor(float(step)) for _ in params], fused=True,
               amsgrad=group["amsgrad"], beta1=group["betas"][0], beta2=group["betas"][1],
               lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=group["maximize"],
               decoupled_weight_decay=group.get("decoupled_weight_decay", False))


def sgd_update(group: dict, params: list, grads: list, states: dict, step: int) -> None:
    """torch's functional SGD (fused CPU kernel); its first step creates the momentum buffers."""
    bufs = states.get("momentum_buffer", [])
    momentum = list(bufs) if bufs and step > 0 and group["momentum"] else [None] * len(params)
    _sgd.sgd(params, grads, momentum, fused=True, weight_decay=group["weight_decay"],
             momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
             nesterov=group["nesterov"], maximize=group["maximize"])
    if bufs and step == 0:
        for mine, made in zip(bufs, momentum):
            if made is not None:
                mine.copy_(made)


Update = Callable[[dict, list, list, dict, int], None]  # (group, params, grads, states, step)


def update_for(template: torch.optim.Optimizer) -> Update:
    """The functional update of `template`'s type (`state_fields` refuses other types)."""
    return sgd_update if isinstance(template, torch.optim.SGD) else adam_update
