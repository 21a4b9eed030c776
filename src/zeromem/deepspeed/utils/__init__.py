"""DeepSpeed's `deepspeed.utils`: its logger, and one parameter's partitioned state.

`safe_get_full_grad(p)`, `safe_get_full_fp32_param(p)`, `safe_get_full_optimizer_state(p,
"exp_avg")` and their `safe_set_full_*` / `safe_get_local_*` / `safe_set_local_*`
counterparts read and write what ZeRO partitions, for a parameter of a model that
`deepspeed.initialize` wrapped (zeromem/param_states.py does the work; it says what
each kind holds). The `get_full` calls are collective, as DeepSpeed's are: every rank
calls them for the same parameters in the same order.

Differences from DeepSpeed, chosen so that a reading is what the step uses:
- the gradient is fp32, averaged over ranks and the accumulation window, with the
  fp16 loss scale removed (DeepSpeed's stage-3 reading keeps the scale), readable
  from the backward that ends a window until `step()`; mid-window, or after the step,
  reading it raises (DeepSpeed returns a partial sum, or zeros);
- `safe_set_full_fp32_param` updates the model's (16-bit) weights at once, where
  DeepSpeed's waits for the next step;
- the local calls work at every stage (this rank's piece of the parameter, 1-D).
Parameters no engine trains (frozen ones) give None, as in DeepSpeed.
`set_z3_leaf_modules(model, [MoEBlock])` flags modules that `deepspeed.initialize` then
gathers as one fetch unit each. `deepspeed.utils.zero_to_fp32` reads checkpoints (its own
module).
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from ...config.leaf_modules import class_named
from ...param_states import GRAD, MASTER, ParamStates
from .logging import log_dist, logger

_ATTRIBUTE = "_zeromem_param_states"  # on each trained parameter: a weak reference


def attach(states: ParamStates, module: nn.Module) -> None:
    """Let the functions below find `states` from the parameters it answers for (as
    DeepSpeed's own find their optimizer through attributes on the parameter)."""
    ref = weakref.ref(states)
    for p in module.parameters():
        if states.owns(p):
            setattr(p, _ATTRIBUTE, ref)


def _states(param: nn.Parameter) -> ParamStates | None:
    ref = getattr(param, _ATTRIBUTE, None)
    return ref() if ref is not None else None


def _ask(param: nn.Parameter, verb: str, *args):
    """`ParamStates.<verb>(param, *args)` for a parameter an engine trains; else None."""
    states = _states(param)
    return getattr(states, verb)(param, *args) if states is not None else None


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of `param`; collective."""
    return _ask(param, "full", MASTER)


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 master of `param` (and its model weights) from the whole `value`."""
    _ask(param, "set_full", MASTER, value)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str
                                  ) -> torch.Tensor | None:
    """The whole optimizer state `optim_state_key` ("exp_avg", ...) of `param`; collective."""
    return _ask(param, "full", optim_state_key)


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor,
                                  optim_state_key: str) -> None:
    _ask(param, "set_full", optim_state_key, value)


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The whole gradient the step will use for `param` (module docstring); collective.
    A parameter no engine trains gives its own `.grad`, as in DeepSpeed."""
    if _states(param) is None:
        return param.grad
    return _ask(param, "full", GRAD)


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make the step use `value` (whole, averaged, unscaled) as `param`'s gradient."""
    if _states(param) is None and param.grad is not None:
        param.grad.copy_(value)
        return
    _ask(param, "set_full", GRAD, value)


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    return _ask(param, "local", GRAD)


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    _ask(param, "set_local", GRAD, value)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    return _ask(param, "local", MASTER)


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    _ask(param, "set_local", MASTER, value)


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str
                                   ) -> torch.Tensor | None:
    return _ask(param, "local", optim_state_key)


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor,
                                   optim_state_key: str) -> None:
    _ask(param, "set_local", optim_state_key, value)


# -- ZeRO-3 leaf modules (DeepSpeed's z3_leaf_module) ----------------------------------
def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    """Flag (or unflag) one module as a ZeRO-3 leaf: `initialize` gathers its parameters,
    its children's included, as one fetch unit (DeepSpeed's `_z3_leaf` attribute)."""
    module._z3_leaf = flag  # type: ignore[assignment]


def z3_leaf_module(module: nn.Module) -> bool:
    return bool(getattr(module, "_z3_leaf", False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list,
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of `model` whose class is in `leaf_module_classes` (classes, or
    class names, short or module-qualified), as MoE recipes do for their sparse blocks
    (Accelerate: `transformer_moe_cls_names`): its experts, which each rank runs in its own
    order, are gathered together on entry, so ranks routing differently still gather the
    same units. Returns the modules flagged."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list,
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True
                                ) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named (as `named_modules()` names them): (modules, names not found)."""
    return _flag_named(model, module_names, flag, raise_if_not_found, lambda name, key: name == key)


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str],
                                  flag: bool = True, raise_if_not_found: bool = True
                                  ) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose names end so: (modules, suffixes that matched none)."""
    return _flag_named(model, module_name_suffixes, flag, raise_if_not_found, str.endswith)


def _flag_classes(model: nn.Module, classes: list, flag: bool,
                  raise_if_not_found: bool) -> list[nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be classes or class names, got {classes}")

    found = [m for m in model.modules()
             if any(isinstance(m, c) if isinstance(c, type) else class_named(m, c) for c in classes)]
    if not found and raise_if_not_found:
        raise ValueError(f"no module of class {classes} in {type(model).__name__}")
    for m in found:
        set_z3_leaf_module(m, flag)
    return found


def _flag_named(model: nn.Module, keys: list[str], flag: bool, raise_if_not_found: bool,
                matches: Callable[[str, str], bool]) -> tuple[list[nn.Module], list[str]]:
    named = list(model.named_modules())
    found = {id(m): m for name, m in named if any(matches(name, k) for k in keys)}
    missing = [k for k in keys if not any(matches(name, k) for name, _ in named)]
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing} in {type(model).__name__}")
    for m in found.values():
        set_z3_leaf_module(m, flag)
    return list(found.values()), missing


__all__ = ["logger", "log_dist", "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "z3_leaf_module", "set_z3_leaf_module", "safe_get_full_fp32_param", "safe_set_full_fp32_param",
           "safe_get_full_optimizer_state", "safe_set_full_optimizer_state",
           "safe_get_full_grad", "safe_set_full_grad", "safe_get_local_grad",
           "safe_set_local_grad", "safe_get_local_fp32_param", "safe_set_local_fp32_param",
           "safe_get_local_optimizer_state", "safe_set_local_optimizer_state"]
