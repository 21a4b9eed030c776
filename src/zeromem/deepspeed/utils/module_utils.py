"""DeepSpeed's `utils.module_utils` (formerly `compression.helper`): dotted submodule access.

DeepSpeed-Chat swaps its LoRA layers in with these (`convert_linear_layer_to_lora`).
"""
from __future__ import annotations

from torch import nn


def recursive_getattr(model: nn.Module, dotted: str):
    """`model.a.b` from 'a.b'."""
    for name in dotted.split("."):
        model = getattr(model, name)
    return model


def recursive_setattr(model: nn.Module, dotted: str, module: nn.Module) -> None:
    """`model.a.b = module` from 'a.b'."""
    parent, _, name = dotted.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, name, module)
