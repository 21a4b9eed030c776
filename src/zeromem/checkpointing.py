"""Activation checkpointing under DeepSpeed's import path (`deepspeed.checkpointing`).

The implementation lives in `activations/recompute.py`; saving and loading model
checkpoints is `checkpoints/save_load.py`.

    zeromem.checkpointing.configure(mp_group, partition_activations=True)
    y = zeromem.checkpointing.checkpoint(block, x)
    zeromem.checkpointing.enable(model)   # HF models, or any model with a list of blocks
"""
from zeromem.activations.enable import enable
from zeromem.activations.recompute import (checkpoint, checkpoint_stats, configure, configure_from_config,
                          estimate_checkpoint_bytes, get_config, held_checkpoint_bytes,
                          reset_peak_checkpoint_bytes)

__all__ = ["enable", "checkpoint", "checkpoint_stats", "configure", "configure_from_config",
           "estimate_checkpoint_bytes", "get_config", "held_checkpoint_bytes",
           "reset_peak_checkpoint_bytes"]
