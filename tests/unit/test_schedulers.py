"""Pure-logic tests of zeromem.optim.schedulers against DeepSpeed's formulas and its printed lrs."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch

from zeromem.config.schema import Config, ConfigError
from zeromem.optim.schedulers import (LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR,
                                build_scheduler)


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


# The lr each optimizer step k = 1..10 uses, as printed by
#     DS_ACCELERATOR=cpu /work/dsvenv/bin/python tools/print_scheduler_lrs.py deepspeed
# (DeepSpeed 0.19.8, torch 2.13.0+cpu: `deepspeed.initialize` over nn.Linear(2, 1), Adam lr 0.01,
# the scheduler blocks in tools/print_scheduler_lrs.py; the lr is read before each engine.step()).
# DeepSpeed keeps the warmup schedules at their start for two steps (WarmupCosineLR: lr 0, then
# warmup_min_ratio); zeromem's ran one step ahead before this data was added.
DEEPSPEED_LRS = {
    "WarmupLR log": [0.001, 0.001, 0.0055, 0.008132331253, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01],
    "WarmupLR linear": [0.001, 0.001, 0.00325, 0.0055, 0.00775, 0.01, 0.01, 0.01, 0.01, 0.01],
    "WarmupLR to the optimizer's lr": [0.001, 0.001, 0.00325, 0.0055, 0.00775, 0.01, 0.01, 0.01,
                                       0.01, 0.01],
    "WarmupDecayLR log": [0.001, 0.001, 0.0055, 0.008132331253, 0.01, 0.01, 0.00775, 0.0055,
                          0.00325, 0.001],
    "WarmupDecayLR linear": [0.001, 0.001, 0.00325, 0.0055, 0.00775, 0.01, 0.00775, 0.0055,
                             0.00325, 0.001],
    "WarmupCosineLR linear": [0.0, 0.001, 0.00325, 0.0055, 0.00775, 0.008550178567, 0.00505,
                              0.001549821433, 0.0001, 0.0001],
    "OneCycle": [0.001, 0.004, 0.007, 0.01, 0.007, 0.004, 0.001, 0.0008, 0.000666666667,
                 0.000571428571],
    "LRRangeTest": [0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.0045, 0.005, 0.0055],
}
# the scheduler blocks that produced DEEPSPEED_LRS: the tool's own, read from it
SCHEDULES = runpy.run_path(str(Path(__file__).parents[2] / "tools" / "print_scheduler_lrs.py"))[
    "SCHEDULES"]


@pytest.mark.parametrize("name", sorted(DEEPSPEED_LRS))
def test_schedules_give_deepspeeds_lr_at_every_step(name):
    """Each schedule, built from the same config block, gives DeepSpeed's lr at every step."""
    kind, params = SCHEDULES[name]
    config = Config.load({"optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                          "scheduler": {"type": kind, "params": params}})
    scheduler = build_scheduler(config.scheduler, make_optimizer(0.01))
    got = [h[0] for h in lrs_by_step(scheduler, len(DEEPSPEED_LRS[name]) - 1)]
    assert got == pytest.approx(DEEPSPEED_LRS[name], abs=1e-12)


def test_warmup_lr_log():
    scheduler = WarmupLR(make_optimizer(), warmup_min_lr=0.01, warmup_max_lr=0.1,
                         warmup_num_steps=10)
    history = lrs_by_step(scheduler, 15)
    assert history[0][0] == history[1][0] == pytest.approx(0.01)
    for step in (1, 5, 10):  # DeepSpeed's iteration is step - 1
        expected = 0.01 + 0.09 * math.log(step) / math.log(10)
        assert history[step][0] == pytest.approx(expected)
    assert history[11][0] == history[15][0] == pytest.approx(0.1)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_warmup_lr_linear_ignores_optimizer_lr():
    scheduler = WarmupLR(make_optimizer(0.5, 7.0), warmup_max_lr=0.2, warmup_num_steps=4,
                         warmup_type="linear")
    history = lrs_by_step(scheduler, 6)
    assert [h[0] for h in history] == pytest.approx([0.0, 0.0, 0.05, 0.1, 0.15, 0.2, 0.2])
    assert history[3][1] == pytest.approx(0.1)  # absolute lr, same for every group


def test_warmup_lr_without_a_max_warms_each_group_up_to_its_own_lr():
    """DeepSpeed 0.19.8; before stop 49 every group went to 0.001 (50x too low for 0.05)."""
    scheduler = WarmupLR(make_optimizer(0.05, 0.5), warmup_num_steps=4, warmup_type="linear")
    history = lrs_by_step(scheduler, 6)
    assert history[-1] == pytest.approx([0.05, 0.5])
    assert history[3] == pytest.approx([0.025, 0.25])


def test_warmup_lr_clamps_one_warmup_step_to_two():
    scheduler = WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=1)
    assert [h[0] for h in lrs_by_step(scheduler, 3)] == pytest.approx([0.0, 0.0, 1.0, 1.0])


def test_warmup_decay_lr():
    scheduler = WarmupDecayLR(make_optimizer(), total_num_steps=20, warmup_max_lr=0.1,
                              warmup_num_steps=10, warmup_type="linear")
    history = [h[0] for h in lrs_by_step(scheduler, 25)]
    assert history[6] == pytest.approx(0.05)
    assert history[11] == pytest.approx(0.1)
    assert history[16] == pytest.approx(0.1 * (20 - 15) / (20 - 10))
    assert history[21] == pytest.approx(0.0) and history[25] == pytest.approx(0.0)


def test_warmup_decay_lr_decays_to_min_lr():
    scheduler = WarmupDecayLR(make_optimizer(), total_num_steps=10, warmup_min_lr=0.01,
                              warmup_max_lr=0.11, warmup_num_steps=2)
    history = [h[0] for h in lrs_by_step(scheduler, 12)]
    assert history[7] == pytest.approx(0.01 + 0.1 * (10 - 6) / 8)
    assert history[11] == pytest.approx(0.01) and history[12] == pytest.approx(0.01)


def test_warmup_cosine_lr_scales_each_group():
    base = (0.1, 0.02)
    total, warmup, cos_min, min_ratio = 30, 10, 0.01, 0.1
    scheduler = WarmupCosineLR(make_optimizer(*base), total_num_steps=total,
                               warmup_min_ratio=min_ratio, warmup_num_steps=warmup,
                               cos_min_ratio=cos_min)
    history = lrs_by_step(scheduler, 40)

    def ratio(iteration: int) -> float:
        if iteration < warmup:
            return min_ratio + (1 - min_ratio) * math.log(iteration + 1) / math.log(warmup)
        progress = min(1.0, (iteration - warmup + 1) / (total - warmup))
        return cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2

    for step in (1, 4, 10, 11, 20, 30, 36):
        assert history[step] == pytest.approx([b * ratio(step - 1) for b in base])
    assert history[0] == [0.0, 0.0]  # DeepSpeed's lr before its first step()
    assert history[1][0] == pytest.approx(0.1 * min_ratio)
    assert history[30][0] == pytest.approx(0.1 * cos_min)
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
    assert [h[0] for h in lrs_by_step(scheduler, 3)] == pytest.approx([0.0, 0.0, 0.125, 0.25])
    assert build_scheduler(Config.load({}).scheduler, make_optimizer()) is None


def test_bad_warmup_type_raises():
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(make_optimizer(), warmup_type="cosine")


# ---------------------------------------------------------------- DeepSpeed's cyclic schedules

class DeepSpeedOneCycle:
    """deepspeed.runtime.lr_schedules.OneCycle's bookkeeping, transcribed: construction sets
    the lr to cycle_min_lr and beta1 to cycle_min_mom; each step() advances
    last_batch_iteration and recomputes from batch_iteration = last_batch_iteration + 1."""

    def __init__(self, min_lr, max_lr, first, second=None, first_stairs=0, second_stairs=None,
                 decay_step=0, decay_lr=0.0, min_mom=0.8, max_mom=0.9, decay_mom=0.0):
        self.min_lr, self.max_lr, self.min_mom, self.max_mom = min_lr, max_lr, min_mom, max_mom
        second = first if second is None else second
        self.first, self.second, self.total = float(first), float(second), float(first + second)
        self.ratio = self.first / self.total
        self.stairs = (first_stairs, first_stairs if second_stairs is None else second_stairs)
        self.decay_step, self.decay_lr, self.decay_mom = decay_step, decay_lr, decay_mom
        self.last = -1
        self.lr, self.mom = min_lr, min_mom

    def scale(self):
        it = self.last + 1
        cycle = math.floor(1 + it / self.total)
        x = 1.0 + it / self.total - cycle
        if x <= self.ratio:
            scale, stairs = x / self.ratio, self.stairs[0]
        else:
            scale, stairs = (x - 1) / (self.ratio - 1), self.stairs[1]
        if stairs > 0:
            into = it % self.total
            pos = (into * stairs / self.first if into <= self.first
                   else (self.total - into) * stairs / self.second)
            scale = math.floor(pos) / stairs
        return scale

    def step(self):
        self.last += 1
        if self.last < self.total:
            s = self.scale()
            self.lr = self.min_lr + (self.max_lr - self.min_lr) * s
            self.mom = self.max_mom - (self.max_mom - self.min_mom) * s
        else:
            d = (self.last - self.total + 1) / self.decay_step if self.decay_step else 0
            self.lr = self.min_lr / (1 + self.decay_lr * d) if self.decay_step and self.decay_lr \
                else self.min_lr
            self.mom = self.max_mom * (1 + self.decay_mom * d) if self.decay_step and self.decay_mom \
                else self.max_mom


def adam(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs or (0.1,)]
    return torch.optim.Adam(groups, betas=(0.9, 0.99))


@pytest.mark.parametrize("kwargs", [
    dict(first=4),  # symmetric cycle, then flat at min
    dict(first=3, second=5, decay_step=2, decay_lr=0.5, decay_mom=0.1),  # asymmetric, decays
    dict(first=6, first_stairs=3),  # staircase, second half as the first
    dict(first=4, second=6, first_stairs=2, second_stairs=3, decay_step=1, decay_lr=1.0),
])
def test_one_cycle_follows_deepspeed_step_by_step(kwargs):
    reference = DeepSpeedOneCycle(0.01, 0.1, **kwargs)
    names = dict(first="cycle_first_step_size", second="cycle_second_step_size",
                 first_stairs="cycle_first_stair_count", second_stairs="cycle_second_stair_count",
                 decay_step="decay_step_size", decay_lr="decay_lr_rate", decay_mom="decay_mom_rate")
    scheduler = OneCycle(adam(0.5, 0.7), cycle_min_lr=0.01, cycle_max_lr=0.1,
                         **{names[k]: v for k, v in kwargs.items()})
    for step in range(25):
        for group in scheduler.optimizer.param_groups:  # every group: absolute lrs
            assert group["lr"] == pytest.approx(reference.lr), (step, kwargs)
            assert group["betas"] == pytest.approx((reference.mom, 0.99)), (step, kwargs)
        scheduler.optimizer.step()
        scheduler.step()
        reference.step()


def test_one_cycle_phases():
    """Up for cycle_first_step_size steps, down for the second, then decay."""
    scheduler = OneCycle(adam(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4,
                         cycle_second_step_size=2, decay_step_size=1, decay_lr_rate=1.0)
    lrs = [h[0] for h in lrs_by_step(scheduler, 8)]
    assert lrs[:7] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 0.5, 0.0])
    assert lrs[7] == pytest.approx(0.0)  # min 0 decays to 0
    moms = [scheduler.momentum_at(s) for s in range(7)]
    assert moms[0] == 0.8 and moms[4] == pytest.approx(0.8) and moms[6] == pytest.approx(0.9)


def test_one_cycle_without_betas_leaves_momentum(caplog):
    with caplog.at_level("WARNING", logger="zeromem"):
        scheduler = OneCycle(make_optimizer(), cycle_min_lr=0.01, cycle_max_lr=0.1,
                             cycle_first_step_size=2)
    assert "cycle_momentum is off" in caplog.text
    scheduler.optimizer.step()
    scheduler.step()
    assert "betas" not in scheduler.optimizer.param_groups[0]


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_follows_deepspeed(staircase):
    scheduler = LRRangeTest(make_optimizer(0.5), lr_range_test_min_lr=0.01,
                            lr_range_test_step_size=3, lr_range_test_step_rate=2.0,
                            lr_range_test_staircase=staircase)
    history = [h[0] for h in lrs_by_step(scheduler, 10)]
    for step, lr in enumerate(history):  # DeepSpeed: (last_batch_iteration + 1) / step_size
        interval = math.floor(step / 3) if staircase else step / 3
        assert lr == pytest.approx(0.01 * (1 + 2.0 * interval))


def test_cyclic_schedules_from_config_and_resume():
    config = Config.load({"scheduler": {"type": "onecycle", "params": {
        "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3}}})
    scheduler = build_scheduler(config.scheduler, adam())
    assert isinstance(scheduler, OneCycle)
    for _ in range(4):
        scheduler.optimizer.step()
        scheduler.step()
    resumed = build_scheduler(config.scheduler, adam())
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.get_last_lr() == scheduler.get_last_lr()
    assert resumed.lr_at(5, 0.1) == scheduler.lr_at(5, 0.1)
    with pytest.raises(ConfigError, match="scheduler.params.cycle_max_lr is required"):
        Config.load({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3}}})
    with pytest.raises(ConfigError, match="lr_range_test_step_size must be >= 1"):
        Config.load({"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}})
