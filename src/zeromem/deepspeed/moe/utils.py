"""DeepSpeed's `deepspeed.moe.utils` helpers that scripts import unconditionally.

zeromem has no mixture-of-experts layers, so no parameter is an expert
parameter: the split leaves the groups as they are.
"""
from __future__ import annotations

from typing import Any


def is_moe_param(param: Any) -> bool:
    """False: zeromem builds no expert parameters."""
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any,
                                                         max_group_size: int | None = None
                                                         ) -> list[dict]:
    """Param groups with expert parameters split out: here, the groups unchanged, as a list."""
    if isinstance(param_groups, dict):
        return [param_groups]
    return list(param_groups)
