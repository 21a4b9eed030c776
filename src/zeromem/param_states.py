"""One trained parameter's state, whole or this rank's part (DeepSpeed's `safe_get_full_*`).

Users inspect and edit what ZeRO partitions: per-layer gradient norms in the training
loop, a master weight re-initialised mid-run, an optimizer state reset. The parameter
itself holds none of it (stage 3: not even its values), so `ParamStates`, built by the
engine, answers for each parameter of its flat groups. A kind is

    "fp32"          the fp32 master
    "grad"          the gradient the step will use: averaged over the data-parallel ranks
                    and the accumulation window, loss scale removed, before clipping;
                    readable from the backward that ends a window until `step()`
    any other name  that optimizer state ("exp_avg", "exp_avg_sq", "momentum_buffer", ...),
                    there once the optimizer has stepped

    full(param, kind)          the whole tensor, fp32, in the parameter's shape, on every
                               rank: each rank puts the piece it owns into a zeroed buffer
                               and one all-reduce over the shard group sums the pieces
                               (they do not overlap); collective
    set_full(param, kind, v)   each rank writes its owned piece of `v`; no collective
    local(param, kind)         this rank's owned piece, 1-D (empty where it owns none)
    set_local(param, kind, v)  write that piece

A master written here reaches the compute-dtype parameters at once (`masters_changed`:
at stages 1-2 an all-gather, so every rank writes);
a gradient written here is what the step then uses. Parameters outside the flat groups
(frozen ones) have no state here: None. Masters on NVMe are refused: each read would
bring the whole swap file into memory, which is what that offload exists to avoid.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from zeromem.flat import FlatParamGroup

if TYPE_CHECKING:
    from zeromem.offload.masters import MastersPlacement
    from zeromem.precision import DynamicScaler, NoScaler, StaticScaler

MASTER, GRAD = "fp32", "grad"


class ParamStates:
    """The engine's flat groups seen one parameter at a time (module docstring).

    From the ZeRO optimizer, which owns the gradients' life, it is handed two callables:
    whether the reduced gradients are a whole window's now, and what to call after a
    master changed."""

    def __init__(self, groups: list[FlatParamGroup], optimizer: torch.optim.Optimizer,
                 masters: MastersPlacement, scaler: NoScaler | StaticScaler | DynamicScaler,
                 device: torch.device, gradient_complete: Callable[[], bool],
                 masters_changed: Callable[[], None]):
        self.optimizer = optimizer
        self.gradient_complete = gradient_complete
        self.masters_changed = masters_changed
        self.masters = masters  # where masters and the gradient the step reads live
        self.scaler = scaler
        self.device = device  # where the all-reduce runs
        self._where = {id(p): (g, slot) for g in groups for p, slot in zip(g.params, g.slots)}

    def owns(self, param: nn.Parameter) -> bool:
        return id(param) in self._where

    def full(self, param: nn.Parameter, kind: str) -> torch.Tensor | None:
        """The whole tensor of `kind` for `param` (fp32, its shape); collective."""
        if not self.owns(param):
            return None
        group, slot = self._where[id(param)]
        start, at, n = group.owned_slice(slot)
        whole = torch.zeros(slot.numel, dtype=torch.float32, device=self.device)
        whole[at:at + n] = self._shard(param, kind)[start:start + n].to(self.device) / \
            self._scale(kind)
        if group.shard_world > 1:  # the group's comm: its ranks' pieces make the whole
            group.comm.all_reduce(whole, kind="all_reduce_param_state")
        return whole.view(slot.shape)

    def set_full(self, param: nn.Parameter, kind: str, value: torch.Tensor) -> None:
        """Make the whole tensor of `kind` for `param` equal `value` (its shape or numel)."""
        if not self.owns(param):
            return
        group, slot = self._where[id(param)]
        if value.numel() != slot.numel:
            raise ValueError(f"set {kind} of {slot.name}: {value.numel()} values for a "
                             f"parameter of {slot.numel} {tuple(slot.shape)}")
        start, at, n = group.owned_slice(slot)
        self._write(param, kind, start, value.reshape(-1)[at:at + n])

    def local(self, param: nn.Parameter, kind: str) -> torch.Tensor | None:
        """This rank's owned piece of `kind` for `param`, 1-D fp32 (a copy)."""
        if not self.owns(param):
            return None
        group, slot = self._where[id(param)]
        start, _, n = group.owned_slice(slot)
        return self._shard(param, kind)[start:start + n].float() / self._scale(kind)

    def set_local(self, param: nn.Parameter, kind: str, value: torch.Tensor) -> None:
        """Write this rank's owned piece of `kind` for `param` (`local`'s numel)."""
        if not self.owns(param):
            return
        group, slot = self._where[id(param)]
        start, _, n = group.owned_slice(slot)
        if value.numel() != n:
            raise ValueError(f"set local {kind} of {slot.name}: {value.numel()} values for "
                             f"this rank's piece of {n}")
        self._write(param, kind, start, value.reshape(-1))

    # -- the shard-shaped tensor of each kind ------------------------------------
    def _scale(self, kind: str) -> float:
        return self.scaler.scale if kind == GRAD else 1.0

    def _write(self, param: nn.Parameter, kind: str, start: int, piece: torch.Tensor) -> None:
        shard = self._shard(param, kind)
        with torch.no_grad():
            shard[start:start + piece.numel()] = piece.to(shard) * self._scale(kind)
        if kind == MASTER:
            self.masters_changed()  # the parameters the next forward uses follow

    def _shard(self, param: nn.Parameter, kind: str) -> torch.Tensor:
        """The flat, shard-sized tensor holding `kind` for `param`'s group."""
        group, slot = self._where[id(param)]
        name = slot.name
        if self.masters.where == "nvme":
            raise NotImplementedError(
                f"{kind} of {name}: with offload_optimizer nvme the masters, optimizer states "
                "and gradients live in swap files, and reading one parameter's would bring "
                "whole files into memory; save_checkpoint and read the checkpoint instead "
                "(zeromem.checkpoints.consolidate), or offload to \"cpu\"")
        if kind == MASTER:
            return group.master
        if kind == GRAD:
            if not self.gradient_complete():
                raise RuntimeError(
                    f"grad of {name}: no whole gradient is held now; read it after the "
                    "backward that ends an accumulation window (is_gradient_accumulation_"
                    "boundary() true) and before step(), which consumes it")
            return self.masters.gradient(group)
        states = self.optimizer.state.get(group.master, {})
        value = states.get(kind)
        if not torch.is_tensor(value) or value.shape != group.master.shape:
            per_element = sorted(k for k, v in states.items()
                                 if torch.is_tensor(v) and v.shape == group.master.shape)
            raise KeyError(f"optimizer state {kind!r} of {name}: the optimizer holds "
                           f"{per_element or 'none yet (states appear at the first step)'}")
        return value
