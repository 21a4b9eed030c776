"""DeepSpeed's stage-0 checkpoints (its default): the optimizer states, matched by position.

At stage 0 DeepSpeed writes no ZeRO partitions: mp_rank_00_model_states.pt holds the module
state dict and, under `optimizer`, the state dict of the optimizer it stepped:

- fp32: the torch optimizer's own (`state` keyed by position, `param_groups` listing the
  positions of each group's parameters: every parameter the optimizer was given, frozen
  ones too; a parameter that never had a gradient has no state). The module holds the
  masters.
- fp16 / bf16: DeepSpeed's FP16_Optimizer around it (`optimizer_state_dict`, the loss
  scale's `cur_scale`, `cur_iter`, `last_overflow_iter`). It keeps the parameters that
  require grad only, each group's fp32 masters either one tensor per parameter
  (`fp32_groups`, torch's optimizers) or one flat tensor per group (`fp32_groups_flat`,
  DeepSpeed's fused Adam, whose state is one flat tensor per group too).

Nothing in the files names the parameter at a position: it is the order of the parameters
the optimizer was given. A loading engine knows it (the param groups it was given, in
their order: `ParamOrder`); without one, the module's parameters in one group are tried.
Every position's tensors are checked against that parameter's shape, so a different order
is refused, never loaded into the wrong parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeromem.checkpoints.deepspeed_pickles import need
from zeromem.checkpoints.tensor_files import CheckpointError

# per param group as the optimizer was given it: (parameter name, requires grad), in order
ParamOrder = list[list[tuple[str, bool]]]


@dataclass
class Stage0:
    """A stage-0 checkpoint's trained parameters, each with its fp32 master and states."""

    params: dict[str, dict[str, torch.Tensor]]  # name -> {"master", "exp_avg", ...}
    shapes: list[dict[str, torch.Size]]         # per param group: its trained parameters
    scalars: list[dict[str, Any]]               # per param group: the optimizer's step, ...
    param_groups: list[dict[str, Any]]          # per param group: lr, betas, ... as saved
    loss_scaler: dict[str, Any]                 # DeepSpeed's loss scaler attributes ({} in fp32)


def scalar_states(states: dict) -> dict[str, Any]:
    """A parameter's scalar states (Adam's step), as torch keeps them: DeepSpeed's FusedAdam
    counts its step in a Python int, which torch's fused AdamW cannot step from."""
    out = {k: v for k, v in states.items() if not (torch.is_tensor(v) and v.dim() > 0)}
    if isinstance(out.get("step"), (int, float)):
        out["step"] = torch.tensor(float(out["step"]))
    return out


def tied_keys(module: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each state dict key whose tensor an earlier key's is (a tied weight: torch.save keeps
    the two one storage; stage 0 saves no `shared_params`) -> that earlier key."""
    first: dict[tuple, str] = {}
    tied = {}
    for key, t in module.items():
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if where in first and t.numel():
            tied[key] = first[where]
        first.setdefault(where, key)
    return tied


def module_order(model: dict) -> ParamOrder:
    """The order without an engine: the module's parameters (not its buffers, a tied weight
    once) in one group, as DeepSpeed takes them when `initialize` is given none."""
    module = need(model, "module", Path("model states"))
    tied, buffers = tied_keys(module), set(model.get("buffer_names") or ())
    return [[(k, True) for k in module if k not in tied and k not in buffers]]


def assemble_stage0(path: Path, model: dict, order: ParamOrder | None) -> Stage0:
    """The trained parameters' masters and optimizer states of the stage-0 checkpoint whose
    model states file (read) is `model`, at `path`."""
    saved = model.get("optimizer")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: a stage-0 checkpoint saved without an optimizer state "
                              "(its model states hold the weights only: load them into the "
                              "module)")
    guessed = order is None
    order = module_order(model) if order is None else order
    low_precision = "fp32_groups" in saved or "fp32_groups_flat" in saved
    base = need(saved, "optimizer_state_dict", path) if low_precision else saved
    groups = list(need(base, "param_groups", path))
    states = dict(need(base, "state", path))
    # FP16_Optimizer keeps the parameters that require grad; torch's keeps what it was given
    named = [[name for name, trains in group if trains or not low_precision] for group in order]
    module = need(model, "module", path)
    _check_counts(path, saved, groups, named, module, guessed)
    params: dict[str, dict[str, torch.Tensor]] = {}
    for gi, group in enumerate(groups):
        masters = _masters(path, saved, gi, named[gi], module)
        group_states = _states(path, saved, states, group, named[gi], masters)
        # without the engine's order, a parameter torch's optimizer kept no state for is
        # taken for frozen (it may have had no gradient yet: its value is kept either way)
        trained = set(group_states) if guessed and not low_precision else \
            {name for name, trains in order[gi] if trains}
        for name, master in masters.items():
            if name in trained:
                params[name] = {"master": master, **group_states.get(name, {})}
    _fill_missing(params)
    shapes = [{n: params[n]["master"].shape for n in group if n in params} for group in named]
    scalars = [_group_scalars(saved, states, g) for g in groups]
    return Stage0(params, shapes, scalars, groups, _loss_scaler(saved, model))


def module_weights(model: dict, order: ParamOrder) -> Stage0:
    """The trained parameters' weights alone, from the module (in the model's dtype, as
    DeepSpeed's load_module_only takes them): for a load that reads no optimizer state."""
    module = need(model, "module", Path("model states"))
    shapes = [{n: module[n].shape for n, trains in group if trains and n in module}
              for group in order]
    params = {n: {"master": module[n].float().clone()} for group in shapes for n in group}
    return Stage0(params, shapes, [{} for _ in order], [{} for _ in order], {})


def _check_counts(path: Path, saved: dict, groups: list[dict], named: list[list[str]],
                  module: dict, guessed: bool) -> None:
    """The saved param groups hold as many parameters as `named` (fused: as many elements)."""
    if "fp32_groups_flat" in saved:
        what = "elements"
        counts = [t.numel() for t in need(saved, "fp32_groups_flat", path)]
        expected = [sum(module[n].numel() for n in g if n in module) for g in named]
    else:
        what = "parameters"
        counts = [len(g.get("params", ())) for g in groups]
        expected = [len(g) for g in named]
    if counts == expected:
        return
    if guessed:
        raise CheckpointError(
            f"{path}: a DeepSpeed stage-0 checkpoint, whose optimizer state numbers its "
            f"parameters by their place in the optimizer DeepSpeed was given: its param groups "
            f"hold {counts} {what}, the module's parameters in one group {expected}, so the "
            "order is not the module's. Load it with engine.load_checkpoint in the script that "
            "saved it (the engine knows the param groups it was given); its weights alone, in "
            "the model's dtype, are the 'module' state dict of mp_rank_00_model_states.pt "
            "(torch.load(..., weights_only=True))")
    raise CheckpointError(f"{path}: a DeepSpeed stage-0 checkpoint, whose optimizer state "
                          f"numbers its parameters by position: its param groups hold {counts} "
                          f"{what}, but the param groups this engine was given hold {expected}")


def _masters(path: Path, saved: dict, gi: int, names: list[str],
             module: dict) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master in param group `gi`, checked against its shape."""
    if "fp32_groups_flat" in saved:
        return _split(path, need(saved, "fp32_groups_flat", path)[gi], names, module, "master")
    if "fp32_groups" in saved:
        tensors = need(saved, "fp32_groups", path)[gi]
        if len(tensors) != len(names):
            raise CheckpointError(f"{path}: param group {gi} has {len(tensors)} fp32 masters "
                                  f"for {len(names)} parameters")
        return {n: _shaped(path, t, n, module, "master") for n, t in zip(names, tensors)}
    return {n: _shaped(path, module[n], n, module, "master") for n in names if n in module}


def _states(path: Path, saved: dict, states: dict, group: dict, names: list[str],
            masters: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The tensor states of each parameter of one param group that has any."""
    positions = list(group.get("params", ()))
    if "fp32_groups_flat" in saved:  # one flat state per group, split as its master
        state = states.get(positions[0], {}) if positions else {}
        pieces = {k: _split(path, v, names, masters, k)
                  for k, v in _tensor_states(state).items()}
        return {n: {k: p[n] for k, p in pieces.items()} for n in names}
    out = {}
    for name, position in zip(names, positions):
        if position in states and name in masters:
            out[name] = {k: _shaped(path, v, name, masters, k)
                         for k, v in _tensor_states(states[position]).items()}
    return out


def _tensor_states(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sorted(state.items()) if torch.is_tensor(v) and v.dim() > 0}


def _split(path: Path, flat: torch.Tensor, names: list[str], shapes: dict,
           what: str) -> dict[str, torch.Tensor]:
    numels = [math.prod(shapes[n].shape) for n in names]
    if flat.numel() != sum(numels):
        raise CheckpointError(f"{path}: the flat {what} of {flat.numel()} elements is not the "
                              f"{sum(numels)} of the parameters {names[:4]}...")
    return {n: t.float().view(shapes[n].shape).clone()
            for n, t in zip(names, flat.split(numels))}


def _shaped(path: Path, tensor: object, name: str, shapes: dict, what: str) -> torch.Tensor:
    if name not in shapes:
        raise CheckpointError(f"{path}: parameter {name!r} is not in the module state dict")
    shape = shapes[name].shape
    if not torch.is_tensor(tensor) or tensor.numel() != math.prod(shape):
        found = list(tensor.shape) if torch.is_tensor(tensor) else type(tensor).__name__
        raise CheckpointError(f"{path}: the {what} at {name!r}'s position has shape {found}, "
                              f"where {name!r} has {list(shape)}: the optimizer was given its "
                              "parameters in another order")
    return tensor.float().reshape(shape).clone()


def _fill_missing(params: dict[str, dict[str, torch.Tensor]]) -> None:
    """A trained parameter that never had a gradient has no state: zeros, as a fresh one."""
    keys = sorted({k for states in params.values() for k in states})
    for states in params.values():
        for key in keys:
            states.setdefault(key, torch.zeros_like(states["master"]))


def _group_scalars(saved: dict, states: dict, group: dict) -> dict[str, Any]:
    """The optimizer's scalar states of one group (its step), from a parameter that has any."""
    for position in group.get("params", ()):
        if position in states:
            return scalar_states(states[position])
    return {}


def _loss_scaler(saved: dict, model: dict) -> dict[str, Any]:
    """FP16_Optimizer's scale, as the attributes of the ZeRO optimizers' loss scaler (it
    keeps no hysteresis: the run resumes with the config's)."""
    if "cur_scale" not in saved:
        return {}
    fp16 = (model.get("ds_config") or {}).get("fp16") or {}
    return {"dynamic": bool(saved.get("dynamic_loss_scale")), "cur_scale": saved["cur_scale"],
            "cur_iter": saved.get("cur_iter", 0),
            "last_overflow_iter": saved.get("last_overflow_iter", -1),
            "cur_hysteresis": fp16.get("hysteresis", 2)}
