"""The optimizer `deepspeed.initialize` returns: DeepSpeed's ZeRO optimizer, as loops step it.

DeepSpeed returns its ZeRO optimizer, whose own `step()` is the whole update: unscale
and clip the reduced gradient, step the fp32 master shards, bring the parameters up to
date. Lightning Fabric steps that object instead of the engine (and its scheduler
itself), and so do scripts written that way. zeromem's update lives in the engine, so
stepping the torch optimizer over the master shards directly would skip the rest;
this object answers `step()` and `zero_grad()` with the engine's, without the scheduler,
as DeepSpeed's does. Its param groups and state are the torch optimizer's own objects,
so a scheduler built over either sets the lr the update reads, and its state dict is
the torch optimizer's.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..engine import Engine
from .zero import offloads_to_host


class DeepSpeedZeroOptimizer(torch.optim.Optimizer):
    """`engine.optimizer` of a `DeepSpeedEngine` that trains; see the module docstring."""

    def __init__(self, engine: Engine):
        inner = engine.optimizer
        assert inner is not None
        # torch's constructor sets up its hook tables; the groups are then the inner's own
        super().__init__([torch.empty(0)], dict(inner.defaults))
        self._engine, self._inner = engine, inner
        self.defaults, self.param_groups, self.state = inner.defaults, inner.param_groups, inner.state
        # The engine's own step steps the inner optimizer, not this one: a scheduler built over
        # this one would warn at its first step that the optimizer had not stepped
        self._opt_called = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The engine's update without its scheduler (counted as a micro-step, so that with
        gradient accumulation it updates at the boundary); `closure` is called first."""
        loss = closure() if closure is not None else None
        self._engine.step_without_scheduler()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    @property
    def cur_scale(self) -> float:
        """The loss scale now (DeepSpeed's fp16 optimizers' name; 1 without fp16)."""
        return self._engine.loss_scale

    def train(self) -> None:
        """A schedule-free optimizer's train mode: its masters move back to where gradients
        are taken, the parameters with them (Accelerate calls it; DeepSpeed 0.19.8 moved the
        masters only, below stage 0). Nothing for other optimizers."""
        self._engine.set_optimizer_mode("train")

    def eval(self) -> None:
        """A schedule-free optimizer's eval mode: the parameters become its average."""
        self._engine.set_optimizer_mode("eval")

    def offload_states(self, include=None, device: str = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's ZeRO optimizer's, which OpenRLHF calls: the engine's (offload/states.py)."""
        if offloads_to_host(device):
            self._engine.offload_states(include, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self._engine.reload_states(non_blocking)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_inner"):  # torch's constructor adds its placeholder group first
            raise NotImplementedError("add_param_group: zeromem lays out its master shards at "
                                      "initialize; pass every group to initialize")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)
        self.param_groups, self.state = self._inner.param_groups, self._inner.state

    def __repr__(self) -> str:
        return f"DeepSpeedZeroOptimizer({self._inner!r})"
