"""DeepSpeed's warmup learning-rate schedules as torch `LRScheduler`s.

Implemented from the documented math of `deepspeed.runtime.lr_schedules` so that a
DeepSpeed config's `scheduler` block gives the same learning rates. The step index is
torch's `last_epoch` (DeepSpeed's `last_batch_iteration`): 0 after construction, +1 per
`step()`. Every learning rate is a closed-form function of that index, so
`state_dict()` / `load_state_dict()` / `get_last_lr()` behave as for any torch scheduler.

Warmup fraction at step s < N (N = warmup_num_steps, clamped to >= 2 as DeepSpeed does,
so that log(N) > 0):  "log": log(s + 1) / log(N);  "linear": s / N.

- WarmupLR:       lr = min + (max - min) * fraction, then max.
- WarmupDecayLR:  as WarmupLR, then lr = min + (max - min) * (T - s) / (T - N), floored at
                  min (reaches min, i.e. 0 by default, at s = T = total_num_steps).
- WarmupCosineLR: lr = base_lr * ratio, where ratio rises from warmup_min_ratio to 1 over
                  the warmup, then ratio = cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2
                  with p = (s - N + 1) / (T - N) (DeepSpeed's offset). Unlike DeepSpeed,
                  p is capped at 1 so the lr stays at cos_min_ratio past T instead of rising.

WarmupLR and WarmupDecayLR set absolute learning rates (the optimizer's lr is ignored, as
in DeepSpeed); WarmupCosineLR scales each param group's own lr.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Literal

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

if TYPE_CHECKING:
    from zeromem.config.schema import SchedulerConfig

logger = logging.getLogger("zeromem")

WarmupType = Literal["log", "linear"]


def warmup_fraction(step: int, warmup_num_steps: int, warmup_type: WarmupType) -> float:
    """How far through the warmup `step` is, from 0 at step 0 towards 1 at warmup_num_steps."""
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


class _ClosedFormSchedule(LRScheduler):
    """Base: each group's lr is `lr_at(step, base_lr)`, a pure function of the step index."""

    def __init__(self, optimizer: Optimizer, warmup_num_steps: int, warmup_type: WarmupType,
                 last_batch_iteration: int) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.warmup_num_steps = max(2, warmup_num_steps)  # log(N) must be > 0
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch=last_batch_iteration)  # steps once: step 0

    def lr_at(self, step: int, base_lr: float) -> float:
        """The learning rate at `step` for a param group whose own lr is `base_lr`."""
        raise NotImplementedError

    def get_lr(self) -> list[float | Tensor]:
        return [self.lr_at(self.last_epoch, float(base_lr)) for base_lr in self.base_lrs]

    def _get_closed_form_lr(self) -> list[float | Tensor]:
        return self.get_lr()


class WarmupLR(_ClosedFormSchedule):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: WarmupType = "log", last_batch_iteration: int = -1) -> None:
        self.warmup_min_lr = warmup_min_lr
        self.warmup_max_lr = warmup_max_lr
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, step: int) -> float:
        """Position between warmup_min_lr (0) and warmup_max_lr (1) at `step`."""
        if step < self.warmup_num_steps:
            return warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, step: int, base_lr: float) -> float:
        return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self.gamma(step)


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

    def gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return super().gamma(step)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - step) / decay_steps)


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

    def ratio(self, step: int) -> float:
        """Multiplier of the param group's own lr at `step`."""
        if step < self.warmup_num_steps:
            fraction = warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, step: int, base_lr: float) -> float:
        return base_lr * self.ratio(step)


# DeepSpeed scheduler name -> class; config/schema.py validates params against these signatures.
SCHEDULERS: dict[str, type[_ClosedFormSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(scheduler_config: SchedulerConfig | None,
                    optimizer: Optimizer) -> LRScheduler | None:
    """The schedule a validated `scheduler` config block names, over `optimizer`; None if none."""
    if scheduler_config is None:
        return None
    return SCHEDULERS[scheduler_config.type](optimizer, **scheduler_config.params)
