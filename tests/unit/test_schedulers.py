"""Pure-logic tests of zeromem.schedulers against DeepSpeed's documented formulas."""

from __future__ import annotations

import math

import pytest
import torch

from zeromem.config.schema import Config
from zeromem.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def make_optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs or (0.1,)]
    return torch.optim.SGD(groups)


def lrs_by_step(scheduler, steps: int) -> list[list[float]]:
    """get_last_lr() after construction (step 0) and after each of `steps` steps."""
    history = [scheduler.get_last_lr()]
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
        history.append(scheduler.get_last_lr())
    return history


def test_warmup_lr_log():
    scheduler = WarmupLR(make_optimizer(), warmup_min_lr=0.01, warmup_max_lr=0.1,
                         warmup_num_steps=10)
    history = lrs_by_step(scheduler, 15)
    for step in (0, 1, 5, 9):
        expected = 0.01 + 0.09 * math.log(step + 1) / math.log(10)
        assert history[step][0] == pytest.approx(expected)
    assert history[10][0] == history[15][0] == pytest.approx(0.1)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_warmup_lr_linear_ignores_optimizer_lr():
    scheduler = WarmupLR(make_optimizer(0.5, 7.0), warmup_max_lr=0.2, warmup_num_steps=4,
                         warmup_type="linear")
    history = lrs_by_step(scheduler, 5)
    assert [h[0] for h in history] == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.2])
    assert history[2][1] == pytest.approx(0.1)  # absolute lr, same for every group


def test_warmup_lr_clamps_one_warmup_step_to_two():
    scheduler = WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=1)
    assert [h[0] for h in lrs_by_step(scheduler, 2)] == pytest.approx([0.0, 1.0, 1.0])


def test_warmup_decay_lr():
    scheduler = WarmupDecayLR(make_optimizer(), total_num_steps=20, warmup_max_lr=0.1,
                              warmup_num_steps=10, warmup_type="linear")
    history = [h[0] for h in lrs_by_step(scheduler, 25)]
    assert history[5] == pytest.approx(0.05)
    assert history[10] == pytest.approx(0.1)
    assert history[15] == pytest.approx(0.1 * (20 - 15) / (20 - 10))
    assert history[20] == pytest.approx(0.0) and history[25] == pytest.approx(0.0)


def test_warmup_decay_lr_decays_to_min_lr():
    scheduler = WarmupDecayLR(make_optimizer(), total_num_steps=10, warmup_min_lr=0.01,
                              warmup_max_lr=0.11, warmup_num_steps=2)
    history = [h[0] for h in lrs_by_step(scheduler, 12)]
    assert history[6] == pytest.approx(0.01 + 0.1 * (10 - 6) / 8)
    assert history[10] == pytest.approx(0.01) and history[12] == pytest.approx(0.01)


def test_warmup_cosine_lr_scales_each_group():
    base = (0.1, 0.02)
    total, warmup, cos_min, min_ratio = 30, 10, 0.01, 0.1
    scheduler = WarmupCosineLR(make_optimizer(*base), total_num_steps=total,
                               warmup_min_ratio=min_ratio, warmup_num_steps=warmup,
                               cos_min_ratio=cos_min)
    history = lrs_by_step(scheduler, 40)

    def ratio(step: int) -> float:
        if step < warmup:
            return min_ratio + (1 - min_ratio) * math.log(step + 1) / math.log(warmup)
        progress = min(1.0, (step - warmup + 1) / (total - warmup))
        return cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2

    for step in (0, 3, 9, 10, 19, 29, 35):
        assert history[step] == pytest.approx([b * ratio(step) for b in base])
    assert history[0][0] == pytest.approx(0.1 * min_ratio)
    assert history[29][0] == pytest.approx(0.1 * cos_min)
    assert history[40][0] == pytest.approx(0.1 * cos_min)  # held, not rising again


def test_state_dict_round_trip():
    def fresh():
        return WarmupDecayLR(make_optimizer(0.3), total_num_steps=50, warmup_max_lr=0.3,
                             warmup_num_steps=5)

    original = fresh()
    lrs_by_step(original, 7)
    state = original.state_dict()
    assert state["last_epoch"] == 7

    restored = fresh()
    restored.load_state_dict(state)
    assert restored.get_last_lr() == original.get_last_lr()
    assert lrs_by_step(restored, 3)[1:] == lrs_by_step(original, 3)[1:]


def test_build_scheduler_from_config():
    config = Config.load({"scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 0.5, "warmup_num_steps": 4, "warmup_type": "linear"}}})
    scheduler = build_scheduler(config.scheduler, make_optimizer())
    assert isinstance(scheduler, WarmupLR)
    assert [h[0] for h in lrs_by_step(scheduler, 2)] == pytest.approx([0.0, 0.125, 0.25])
    assert build_scheduler(Config.load({}).scheduler, make_optimizer()) is None


def test_bad_warmup_type_raises():
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(make_optimizer(), warmup_type="cosine")
