"""`deepspeed.ops.lion`: DeepSpeedCPULion as zeromem's Lion, DeepSpeed's math (ops/__init__.py)."""
from __future__ import annotations

from zeromem.optim.optimizers import Lion


class DeepSpeedCPULion(Lion):
    """DeepSpeed's CPU Lion."""

    def __init__(self, model_params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
