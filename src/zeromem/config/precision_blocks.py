"""The precision blocks of a DeepSpeed config: `fp16`, `bf16`, `torch_autocast` and
`data_types` (REFERENCE.md section 2.2). The compute dtype they give is `Config.compute_dtype`;
which dtype the module's buffers take, `zeromem.module_dtypes`.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from zeromem.config.rules import ConfigError, Unsupported
from zeromem.config.types import Bool, Dtype, Float, Int, _Block

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KeepInFp32 = Literal["auto"] | list[str]  # "auto": the model's own HF lists


class FP16Config(_Block):
    """`fp16`: fp16 mixed precision with fp32 master weights and dynamic loss scaling."""

    enabled: Bool = False
    auto_cast: Bool = False  # cast module inputs to fp16
    loss_scale: Float = Field(0.0, ge=0)  # 0 = dynamic scaling; > 0 = this static scale
    initial_scale_power: Int = Field(16, ge=0, le=127)  # dynamic scale starts at 2**power
    # (le=127: a larger scale is not a finite fp32 number, and 2**1024 overflows a float)
    loss_scale_window: Int = Field(1000, ge=1)  # clean steps before the scale doubles
    hysteresis: Int = Field(2, ge=1)  # overflows tolerated before the scale halves
    consecutive_hysteresis: Bool = False  # refill hysteresis on every clean step
    min_loss_scale: Float = Field(1.0, gt=0)  # floor; overflowing at the floor raises
    fp16_master_weights_and_grads: Bool = False  # keep masters/grads in fp16 (ZeRO-2 only)


class BF16Config(_Block):
    """`bf16` (alias `bfloat16`): bf16 mixed precision, no loss scaling.

    `bf16_master_weights_and_grads` with `bf16_optimizer_states` (DeepSpeed's PR 7700):
    no fp32 master; the optimizer steps the bf16 parameter shard itself, with the reduced
    bf16 gradient, and keeps its states in bf16 (12 bytes a parameter with Adam become 4)."""

    enabled: Bool = False
    immediate_grad_update: Bool = False  # apply grads as soon as they are accumulated
    bf16_master_weights_and_grads: Bool = False  # masters and their gradients in bf16
    bf16_optimizer_states: Bool = False  # optimizer states in bf16 (needs the above)

    @model_validator(mode="after")
    def _states_need_masters(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16_optimizer_states needs bf16_master_weights_and_grads "
                             "(as DeepSpeed asserts): the states take the masters' dtype")
        if self.bf16_master_weights_and_grads and not self.bf16_optimizer_states:
            raise Unsupported("bf16.bf16_master_weights_and_grads", "bf16 master weights with "
                              "fp32 optimizer states", "DeepSpeed runs it only with "
                              "offload_optimizer and its CPU Adam's fp32 moments; zeromem's "
                              "optimizers keep their states in the masters' dtype: set "
                              "bf16.bf16_optimizer_states too", True)
        if self.bf16_master_weights_and_grads and not self.enabled:
            raise ValueError("bf16_master_weights_and_grads needs bf16.enabled: the masters "
                             "are the bf16 parameters")
        return self


def check_bf16_masters(bf16: BF16Config, stage: int, offload_optimizer: str) -> None:
    """bf16 masters where zeromem keeps them: the parameter shard on the device, or host
    memory (`offload_optimizer` cpu, as DeepSpeed's CPU Adam with bf16 moments), stages 1-3
    (DeepSpeed asserts a ZeRO stage too)."""
    if not bf16.bf16_master_weights_and_grads:
        return
    if stage == 0:
        raise ConfigError("bf16.bf16_master_weights_and_grads needs zero_optimization.stage "
                          "1, 2 or 3 (as DeepSpeed asserts), got 0")
    if offload_optimizer == "nvme":
        raise Unsupported("zero_optimization.offload_optimizer.device", "bf16 master weights "
                          "with NVMe optimizer offload", "zeromem's swap files hold fp32 "
                          "masters and states; offload them to \"cpu\" instead", "nvme")


class TorchAutocastConfig(_Block):
    """`torch_autocast`: the engine's forward runs under `torch.autocast` in `dtype`, over the
    parameters as the fp16/bf16 blocks leave them (fp32 without them), as DeepSpeed's does.

    bfloat16 only: float16 autocast needs loss scaling, which is the fp16 block's. `dtype`
    must be said: DeepSpeed leaves it to torch's device default (float16 on CUDA). Gradients
    are reduced in their own dtype (fp32 over fp32 parameters, as DDP and FSDP2 do);
    DeepSpeed reduces those of `lower_precision_safe_modules` in `dtype`, half the bytes."""

    enabled: Bool = False
    dtype: str | None = None  # "bfloat16" (also "bf16", "torch.bfloat16")
    lower_precision_safe_modules: list[str] | None = None  # DeepSpeed's reduce dtype (WARNED)

    @model_validator(mode="after")
    def _bfloat16_only(self) -> TorchAutocastConfig:
        if not self.enabled:
            return self
        name = (self.dtype or "").removeprefix("torch.")
        if name in ("fp16", "float16", "half"):
            raise Unsupported("torch_autocast.dtype", "float16 autocast", "it needs loss "
                              "scaling: set fp16.enabled (zeromem's dynamic loss scaling), or "
                              "autocast in bfloat16", self.dtype)
        if name not in ("bf16", "bfloat16"):
            raise ValueError(f"dtype {self.dtype!r}: set \"bfloat16\" (DeepSpeed leaves an "
                             "unset dtype to torch: float16 on CUDA)")
        return self


class DataTypesConfig(_Block):
    """`data_types`: dtypes that may differ from the compute dtype (module_dtypes.py)."""

    grad_accum_dtype: Dtype | None = None  # gradient accumulation buffer; None = compute dtype
    param_dtype: Dtype | None = None  # must be the precision block's (DeepSpeed's assertion)
    buffer_dtype: Dtype | None = None  # every floating buffer's; None: as module_dtypes says
    keep_in_fp32_modules: KeepInFp32 = "auto"  # buffer names kept in fp32
