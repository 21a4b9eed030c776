"""DeepSpeed's warmup learning-rate schedules as torch `LRScheduler`s.

Implemented from `deepspeed.runtime.lr_schedules` so that a DeepSpeed config's `scheduler`
block gives the same learning rate at every optimizer step (checked against DeepSpeed's
own output in tests/unit/test_schedulers.py). The step index s is torch's `last_epoch`:
0 after construction, +1 per `step()`, so s = DeepSpeed's `last_batch_iteration` + 1 for
every schedule here. Every learning rate is a closed-form function of s, so
`state_dict()` / `load_state_dict()` / `get_last_lr()` behave as for any torch scheduler.

The warmup schedules evaluate DeepSpeed's formulas at its iteration i = s - 1. DeepSpeed
sets the lr of a not-yet-stepped schedule (i = -1) to the warmup's start, and its
formulas give that start again at i = 0: the first two optimizer steps both run at the
minimum (WarmupCosineLR: the first at lr 0, the second at warmup_min_ratio).

Warmup fraction at iteration 0 <= i < N (N = warmup_num_steps, clamped to >= 2 as DeepSpeed
does, so that log(N) > 0):  "log": log(i + 1) / log(N);  "linear": i / N.

- WarmupLR:       lr = min + (max - min) * fraction, then max.
- WarmupDecayLR:  as WarmupLR, then lr = min + (max - min) * (T - i) / (T - N), floored at
                  min (reaches min, i.e. 0 by default, at i = T = total_num_steps).
- WarmupCosineLR: lr = base_lr * ratio, where ratio rises from warmup_min_ratio to 1 over
                  the warmup, then ratio = cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2
                  with p = min(1, (i - N + 1) / (T - N)) (DeepSpeed's offset and cap);
                  ratio 0 at i = -1.

WarmupLR and WarmupDecayLR set absolute learning rates (the optimizer's lr is ignored, as
in DeepSpeed); WarmupCosineLR scales each param group's own lr.

DeepSpeed's cyclic schedules, after `deepspeed.runtime.lr_schedules` (its step index
`last_batch_iteration + 1` is the index here, so index 0 is the value set at construction):

- LRRangeTest:    lr = min_lr * (1 + rate * s / size)  (staircase: floor(s / size)).
- OneCycle:       one cycle of cycle_first_step_size steps up from cycle_min_lr to
                  cycle_max_lr and cycle_second_step_size steps back down (optionally in
                  stairs), then lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size),
                  d steps past the cycle (no decay when either is 0). With cycle_momentum and
                  an optimizer with betas, beta1 cycles the other way between cycle_max_mom
                  and cycle_min_mom (after the cycle: cycle_max_mom * (1 + decay_mom_rate * d /
                  decay_step_size)), and beta2 is set to 0.99, as DeepSpeed does; at
                  construction beta1 is cycle_min_mom (DeepSpeed's initial value).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zeromem.config.types import Bool, Float, Int

if TYPE_CHECKING:
    from zeromem.config.schema import SchedulerConfig

logger = logging.getLogger("zeromem")

WarmupType = Literal["log", "linear"]


def warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: WarmupType) -> float:
    """How far through the warmup DeepSpeed's `iteration` is: 0 at 0, towards 1 at
    warmup_num_steps."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _ClosedForm(LRScheduler):
    """Base: each group's lr is `lr_at(step, base_lr)`, a pure function of the step index."""

    def lr_at(self, step: int, base_lr: float) -> float:
        """The learning rate at `step` for a param group whose own lr is `base_lr`."""
        raise NotImplementedError

    def get_lr(self) -> list[float | Tensor]:
        return [self.lr_at(self.last_epoch, float(base_lr)) for base_lr in self.base_lrs]

    def _get_closed_form_lr(self) -> list[float | Tensor]:
        return self.get_lr()


class _ClosedFormSchedule(_ClosedForm):
    """Base of the warmup schedules: DeepSpeed's formulas at its iteration `step - 1`."""

    def __init__(self, optimizer: Optimizer, warmup_num_steps: int, warmup_type: WarmupType,
                 last_batch_iteration: int) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.warmup_num_steps = max(2, warmup_num_steps)  # log(N) must be > 0
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch=last_batch_iteration)  # steps once: step 0

    def lr_at(self, step: int, base_lr: float) -> float:
        # DeepSpeed's schedule is at iteration -1 until its first step() (module docstring)
        return self.lr_at_iteration(step - 1, base_lr)

    def lr_at_iteration(self, iteration: int, base_lr: float) -> float:
        """DeepSpeed's lr at its `last_batch_iteration` = `iteration` (-1: not stepped yet)."""
        raise NotImplementedError


class WarmupLR(_ClosedFormSchedule):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold.

    Without warmup_max_lr each param group warms up to its own lr, as in DeepSpeed 0.19.8
    (before stop 49 zeromem took DeepSpeed's older default, 0.001, for every group)."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000,
                 warmup_type: WarmupType = "log", last_batch_iteration: int = -1) -> None:
        self.warmup_min_lr = warmup_min_lr
        self.warmup_max_lr = warmup_max_lr
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        """Position between warmup_min_lr (0) and warmup_max_lr (1) at DeepSpeed's `iteration`."""
        if iteration < self.warmup_num_steps:
            return warmup_fraction(max(iteration, 0), self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at_iteration(self, iteration: int, base_lr: float) -> float:
        top = base_lr if self.warmup_max_lr is None else self.warmup_max_lr
        return self.warmup_min_lr + (top - self.warmup_min_lr) * self.gamma(iteration)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay back to warmup_min_lr at total_num_steps."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: WarmupType = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        if total_num_steps < warmup_num_steps:
            logger.warning("WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                           total_num_steps, warmup_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super().gamma(iteration)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_ClosedFormSchedule):
    """Scale each group's lr from warmup_min_ratio up to 1, then down a cosine to cos_min_ratio."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: WarmupType = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        if total_num_steps < warmup_num_steps:
            logger.warning("WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                           total_num_steps, warmup_num_steps)
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def ratio(self, iteration: int) -> float:
        """Multiplier of the param group's own lr at DeepSpeed's `iteration`."""
        if iteration < 0:
            return 0.0  # DeepSpeed's lr before its first step()
        if iteration < self.warmup_num_steps:
            fraction = warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at_iteration(self, iteration: int, base_lr: float) -> float:
        return base_lr * self.ratio(iteration)


Positive = Annotated[Int, Field(ge=1)]
NonNegative = Annotated[Float, Field(ge=0)]


class LRRangeTest(_ClosedForm):
    """Raise the lr from lr_range_test_min_lr by step_rate every step_size steps (LR range test)."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: NonNegative = 1e-3,
                 lr_range_test_step_size: Positive = 2000, lr_range_test_step_rate: NonNegative = 1.0,
                 lr_range_test_staircase: Bool = False, last_batch_iteration: int = -1) -> None:
        self.min_lr = lr_range_test_min_lr
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def lr_at(self, step: int, base_lr: float) -> float:
        interval = step // self.step_size if self.staircase else step / self.step_size
        return self.min_lr * (1 + self.step_rate * interval)


class OneCycle(_ClosedForm):
    """DeepSpeed's 1Cycle: lr (and beta1, inversely) over one cycle, then a decay."""

    def __init__(self, optimizer: Optimizer, cycle_min_lr: NonNegative, cycle_max_lr: NonNegative,
                 decay_lr_rate: NonNegative = 0.0, cycle_first_step_size: Positive = 2000,
                 cycle_second_step_size: Annotated[Int, Field(ge=0)] | None = None,
                 cycle_first_stair_count: Annotated[Int, Field(ge=0)] = 0,
                 cycle_second_stair_count: Annotated[Int, Field(ge=0)] | None = None,
                 decay_step_size: Annotated[Int, Field(ge=0)] = 0, cycle_momentum: Bool = True,
                 cycle_min_mom: Annotated[Float, Field(ge=0, lt=1)] = 0.8,
                 cycle_max_mom: Annotated[Float, Field(ge=0, lt=1)] = 0.9,
                 decay_mom_rate: NonNegative = 0.0, last_batch_iteration: int = -1) -> None:
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.first_step_size = cycle_first_step_size
        self.second_step_size = (cycle_first_step_size if cycle_second_step_size is None
                                 else cycle_second_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            logger.warning("OneCycle: cycle_momentum is off: %s has no betas (as in DeepSpeed)",
                           type(optimizer).__name__)
        if self.cycle_momentum and optimizer.defaults["betas"][1] != 0.99:
            logger.warning("OneCycle sets beta2 to 0.99 (as DeepSpeed's does), not %s",
                           optimizer.defaults["betas"][1])
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def scale(self, step: int) -> float:
        """Where `step` is between the cycle's low (0) and high (1) point."""
        cycle = math.floor(1 + step / self.total_size)
        x = 1.0 + step / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # flat for each of `stairs` parts of the half cycle
            into = step % self.total_size
            position = (into * stairs / self.first_step_size if into <= self.first_step_size
                        else (self.total_size - into) * stairs / self.second_step_size)
            scale = math.floor(position) / stairs
        return scale

    def _decaying(self, rate: float) -> bool:
        return not (math.isclose(self.decay_step_size, 0) or math.isclose(rate, 0))

    def lr_at(self, step: int, base_lr: float) -> float:
        if step <= self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self.scale(step)
        if not self._decaying(self.decay_lr_rate):
            return self.min_lr
        past = (step - self.total_size) / self.decay_step_size
        return self.min_lr / (1 + self.decay_lr_rate * past)

    def momentum_at(self, step: int) -> float:
        """beta1 at `step`."""
        if step == 0:
            return self.min_mom  # DeepSpeed's value at construction
        if step <= self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale(step)
        if not self._decaying(self.decay_mom_rate):
            return self.max_mom
        return self.max_mom * (1 + self.decay_mom_rate * (step - self.total_size) / self.decay_step_size)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)  # type: ignore[arg-type]
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (self.momentum_at(self.last_epoch), 0.99)


# DeepSpeed scheduler name -> class; config/optimizer_blocks.py validates params against these
# signatures (an Annotated hint is the keyword's rule as it stands).
SCHEDULERS: dict[str, type[_ClosedForm]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
    "LRRangeTest": LRRangeTest, "OneCycle": OneCycle}


def build_scheduler(scheduler_config: SchedulerConfig | None,
                    optimizer: Optimizer) -> LRScheduler | None:
    """The schedule a validated `scheduler` config block names, over `optimizer`; None if none."""
    if scheduler_config is None:
        return None
    return SCHEDULERS[scheduler_config.type](optimizer, **scheduler_config.params)
