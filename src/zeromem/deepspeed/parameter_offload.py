"""DeepSpeed's ZeRO-3 hook owner, as TRL reaches for it: `engine.optimizer.parameter_offload`.

TRL's `unwrap_model_for_generation` (GRPO, online DPO, PPO, GKD trainers) makes a ZeRO-3
model whole with `GatheredParameters(model.parameters())`, then takes DeepSpeed's
fetch hooks off for the generation (`remove_hooks`) and puts them back after
(`add_hooks`). It does so through DeepSpeed's internals: this object's `module`,
`forward_hooks` and `backward_hooks` and `_register_deepspeed_module`, each parameter's
`ds_active_sub_modules`, and the root module's `ds_external_parameters()`.

zeromem's fetch hooks need not come off. While `GatheredParameters` pins every unit
whole, each hook finds its unit gathered and releases nothing. So the names are
offered with nothing behind them: the hook lists are empty, and registering again
does nothing.
"""
from __future__ import annotations

import types

from torch import nn


def _no_external_parameters(module: nn.Module) -> tuple:
    """zeromem traces parameters used outside their module (stage3/fetch.py): none to list."""
    return ()


class ParameterOffload:
    """The names TRL's `remove_hooks` / `add_hooks` read on a ZeRO-3 engine's optimizer."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.forward_hooks: list = []
        self.backward_hooks: list = []
        for p in module.parameters():
            p.ds_active_sub_modules = set()  # type: ignore[attr-defined]
        if not hasattr(module, "ds_external_parameters"):
            module.ds_external_parameters = types.MethodType(  # type: ignore[assignment]
                _no_external_parameters, module)

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Nothing to register again: zeromem's hooks stayed on."""
