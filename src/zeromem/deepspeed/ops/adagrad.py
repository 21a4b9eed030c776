"""`deepspeed.ops.adagrad`: DeepSpeedCPUAdagrad as torch's Adagrad (ops/__init__.py)."""
from __future__ import annotations

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's CPU Adagrad (its `amsgrad` is accepted and, as there, unused)."""

    def __init__(self, model_params, lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
