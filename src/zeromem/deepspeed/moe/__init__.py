"""DeepSpeed's `deepspeed.moe`: only what scripts without MoE layers import (`moe.utils`)."""
from . import utils

__all__ = ["utils"]
