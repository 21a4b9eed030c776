"""Loss scaling for fp16 training, with DeepSpeed's semantics (REFERENCE.md 2.2).

The dynamic scaler starts at 2**initial_scale_power. An overflow (a non-finite
gradient norm on any rank) skips the step; after `hysteresis` overflows the scale
halves (never below `min_loss_scale`; an overflow at the floor raises). Once
`loss_scale_window` clean steps have passed since the last overflow (or the start),
the next clean step doubles the scale and refills the hysteresis budget, and so
every `loss_scale_window` clean steps after that: DeepSpeed 0.19's count, which grows
one step later than older DeepSpeed releases did. The state (`state_dict`) is
DeepSpeed's `DynamicLossScaler` renamed: scale = cur_scale, hysteresis_left =
cur_hysteresis, iteration = cur_iter, last_overflow_iteration = last_overflow_iter,
so that DeepSpeed checkpoints resume with their scale (`checkpoints/deepspeed_import.py`).
bf16 and fp32 use `NoScaler`.
"""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("zeromem")

# The parameters whose gradient on this rank holds inf or nan, read only when a message
# needs them (a pass over the gradients; not for fp16's routine overflows)
Culprits = Callable[[], list[str]]


def _named(culprits: Culprits) -> str:
    names = culprits()
    shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more"
                                                      if len(names) > 8 else "")
    return f"inf or nan in the gradient of {shown}" if names else \
        ("no inf or nan in what this rank holds of the gradient: another rank holds it (or, "
         "on NVMe, the step in backward used that part up)")


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients keep overflowing although the loss scale is at its floor."""


class NoScaler:
    """bf16 and fp32: no scaling, and no overflow checks beyond the gradient norm."""

    scale = 1.0
    dynamic = False

    def update(self, overflow: bool, culprits: Culprits = list) -> None:
        if overflow:
            log.warning("non-finite gradient norm; step skipped: %s", _named(culprits))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class StaticScaler(NoScaler):
    """fp16 with a fixed `loss_scale`."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state.get("scale", self.scale))


class DynamicScaler:
    """fp16 dynamic loss scaling with hysteresis."""

    dynamic = True

    def __init__(self, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False,
                 min_loss_scale: float = 1.0, scale_factor: float = 2.0):
        self.scale = float(2 ** initial_scale_power)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_loss_scale)
        self.factor = scale_factor
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool, culprits: Culprits = list) -> None:
        """Advance the state machine by one optimizer step."""
        if overflow:
            if self.hysteresis_left <= 1:
                if self.scale <= self.min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 gradients overflowed with the loss scale already at its minimum "
                        f"({self.min_scale:g}); training cannot go on ({_named(culprits)}). "
                        "Lower the learning rate, check the data for inf/nan, or train in bf16.")
                self.scale = max(self.scale / self.factor, self.min_scale)
                log.info("fp16 overflow: loss scale lowered to %g", self.scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            clean_before = self.iteration - self.last_overflow_iteration - 1
            if clean_before > 0 and clean_before % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in
                ("scale", "hysteresis_left", "iteration", "last_overflow_iteration")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def make_scaler(fp16_config) -> NoScaler | StaticScaler | DynamicScaler:
    """The scaler the `fp16` config block asks for (`NoScaler` when fp16 is off)."""
    if not fp16_config.enabled:
        return NoScaler()
    if fp16_config.loss_scale and fp16_config.loss_scale > 0:
        return StaticScaler(fp16_config.loss_scale)
    return DynamicScaler(fp16_config.initial_scale_power, fp16_config.loss_scale_window,
                         fp16_config.hysteresis, fp16_config.consecutive_hysteresis,
                         fp16_config.min_loss_scale)
