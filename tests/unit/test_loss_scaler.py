"""The fp16 loss-scaler state machine (DeepSpeed semantics): pure, no process group."""
from __future__ import annotations

import pytest

from zeromem.precision import DynamicScaler, LossScaleAtMinimumError


def test_hysteresis_delays_the_first_halving():
    s = DynamicScaler(initial_scale_power=4, loss_scale_window=1000, hysteresis=2)
    s.update(True)
    assert s.scale == 16  # first overflow spends hysteresis
    s.update(True)
    assert s.scale == 8
    s.update(True)
    assert s.scale == 4  # hysteresis stays spent until a window passes


def test_scale_doubles_on_the_clean_step_after_a_clean_window():
    """DeepSpeed 0.19's DynamicLossScaler: after an overflow, `loss_scale_window` clean steps
    pass at the lowered scale, and the next clean step doubles it (then every window)."""
    s = DynamicScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    s.update(True)
    assert s.scale == 8
    for _ in range(3):
        s.update(False)
    assert s.scale == 8
    s.update(False)
    assert s.scale == 16
    for _ in range(2):
        s.update(False)
    assert s.scale == 16
    s.update(False)
    assert s.scale == 32


def test_scale_first_grows_after_window_plus_one_clean_steps():
    s = DynamicScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    s.update(False)
    s.update(False)
    assert s.scale == 16
    s.update(False)
    assert s.scale == 32


def test_overflow_at_minimum_raises():
    s = DynamicScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    s.update(True)
    assert s.scale == 1
    with pytest.raises(LossScaleAtMinimumError, match="minimum"):
        s.update(True)


def test_consecutive_hysteresis_refills_on_every_clean_step():
    s = DynamicScaler(initial_scale_power=4, loss_scale_window=100, hysteresis=2,
                      consecutive_hysteresis=True)
    s.update(True)
    s.update(False)
    s.update(True)
    assert s.scale == 16  # refilled, so this overflow only spent hysteresis again
