"""One call that makes a model's blocks checkpoint through `zeromem.checkpoint` (ZeRO-R 6.1).

The `activation_checkpointing` config block (Pa, Pa+cpu, MD) acts on the calls a
model makes to `zeromem.checkpoint`; a model that never calls it (a Hugging Face
model, a plain `nn.ModuleList` of blocks) keeps all its activations whatever the
config says. `enable(model)` routes its repeated blocks through `zeromem.checkpoint`:

- a Hugging Face model: `gradient_checkpointing_enable()` (so the model also drops
  its KV cache in training, as it does for torch's checkpoint), then every layer's
  checkpoint function is `zeromem.checkpoint`;
- any other model: each element of its longest `nn.ModuleList` runs its `forward`
  under `zeromem.checkpoint` (an attribute on that instance; parameter names and
  the state dict stay as they were, and module hooks stay outside the checkpoint,
  so stage 3's gathers run again in the recompute).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

from zeromem.activations.recompute import checkpoint


def _checkpointed(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, **kwargs)


def enable(model: nn.Module) -> str:
    """Checkpoint `model`'s blocks through `zeromem.checkpoint`; returns what was done.

    Raises ValueError naming the model when it has neither Hugging Face layers nor a
    `nn.ModuleList` of blocks.
    """
    if hasattr(model, "gradient_checkpointing_enable"):
        # transformers 5 renamed it and warns on the old name; older versions have only that
        turn_on = getattr(model, "activation_checkpointing_enable", None)
        if turn_on is None:
            turn_on = getattr(model, "gradient_checkpointing_enable")
        turn_on()
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
        for module in model.modules():
            if hasattr(module, "gradient_checkpointing"):
                setattr(module, "_gradient_checkpointing_func", checkpoint)
        return (f"{type(model).__name__}: gradient checkpointing through zeromem.checkpoint "
                f"({len(layers)} layers)")
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"zeromem.checkpointing.enable: {type(model).__name__} has no Hugging "
                         "Face layers and no nn.ModuleList of blocks to checkpoint; call "
                         "zeromem.checkpoint(block, x) in its forward instead")
    name, blocks = max(lists, key=lambda item: len(item[1]))
    for block in blocks:
        if not isinstance(block.forward, functools.partial):  # enable twice = once
            block.forward = functools.partial(_checkpointed, block.forward)
    return f"{name} ({len(blocks)} blocks) each under zeromem.checkpoint"
