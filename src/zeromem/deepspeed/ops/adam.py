"""`deepspeed.ops.adam`: FusedAdam and DeepSpeedCPUAdam as torch's fused Adam (ops/__init__.py)."""
from __future__ import annotations

import torch


def _adam_options(bias_correction: bool, betas, eps: float, weight_decay: float, amsgrad: bool,
                  adamw_mode: bool, name: str) -> dict:
    if not bias_correction:  # torch's Adam always corrects
        raise NotImplementedError(
            f"{name}(bias_correction=False): give the config an optimizer block instead "
            '({"type": "Adam", "params": {"bias_correction": false, ...}}), which runs '
            "DeepSpeed's FusedAdam math")
    return dict(betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                decoupled_weight_decay=adamw_mode, fused=True)


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam: AdamW when `adam_w_mode`, else Adam with L2 decay."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
        super().__init__(params, lr=lr, **_adam_options(bias_correction, betas, eps, weight_decay,
                                                        amsgrad, adam_w_mode, "FusedAdam"))


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam: AdamW when `adamw_mode`, else Adam with L2 decay. Its states
    take the masters' dtype whatever `fp32_optimizer_states` says: fp32, or bf16 under
    bf16.bf16_optimizer_states (where DeepSpeed too overrides the flag to false)."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, **_adam_options(
            bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode, "DeepSpeedCPUAdam"))
