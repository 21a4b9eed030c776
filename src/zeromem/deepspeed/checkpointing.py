"""DeepSpeed's `deepspeed.checkpointing`: activation checkpointing under DeepSpeed's signature.

`zeromem.checkpointing.configure` takes the config block's key names. DeepSpeed's
`configure(mpu_, deepspeed_config=None, partition_activations=None,
contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
synchronize=None, profile=None)` takes a Megatron-style `mpu_` first and names of its
own, and is what Megatron-DeepSpeed and Lightning's DeepSpeedStrategy call. As in
DeepSpeed, the policy starts from the defaults, then the `activation_checkpointing`
block of `deepspeed_config` (a path or a dict), then every argument that is not None.
Everything else is zeromem's `checkpointing` module as it is.
"""
from __future__ import annotations

import os
from typing import Any

from pydantic import ValidationError

from ..activations import recompute
from ..activations.store import ActivationPolicy
from ..checkpointing import (checkpoint, checkpoint_stats, enable, estimate_checkpoint_bytes,
                             get_config, held_checkpoint_bytes, reset_peak_checkpoint_bytes)
from ..config.rules import ConfigError, humanise
from ..config.schema import ActivationCheckpointingConfig, _read_json

# DeepSpeed's argument -> the config block's key
_NAMES = {"partition_activations": "partition_activations",
          "contiguous_checkpointing": "contiguous_memory_optimization",
          "num_checkpoints": "number_checkpoints",
          "checkpoint_in_cpu": "cpu_checkpointing",
          "synchronize": "synchronize_checkpoint_boundary",
          "profile": "profile"}


def configure(mpu_: Any, deepspeed_config: dict | str | os.PathLike | None = None,
              partition_activations: bool | None = None, contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None, checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None, profile: bool | None = None) -> ActivationPolicy:
    """Set the policy `checkpoint` uses; see the module docstring for the order."""
    values = _block(deepspeed_config).model_dump()
    given = {"partition_activations": partition_activations,
             "contiguous_checkpointing": contiguous_checkpointing,
             "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
             "synchronize": synchronize, "profile": profile}
    values.update({_NAMES[name]: value for name, value in given.items() if value is not None})
    return recompute.configure(_model_parallel_group(mpu_), **values)


def _block(deepspeed_config: dict | str | os.PathLike | None) -> ActivationCheckpointingConfig:
    """The `activation_checkpointing` block of a DeepSpeed config, checked as `initialize` checks it."""
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, (str, os.PathLike)):
        deepspeed_config = _read_json(os.fspath(deepspeed_config))
    if not isinstance(deepspeed_config, dict):
        raise TypeError("deepspeed.checkpointing.configure: deepspeed_config must be a path "
                        f"or a dict, got {type(deepspeed_config).__name__}")
    try:
        return ActivationCheckpointingConfig.model_validate(
            deepspeed_config.get("activation_checkpointing", {}))
    except ValidationError as error:  # a misspelt key is named, as `initialize` names it
        raise ConfigError(humanise(error, ActivationCheckpointingConfig,
                                   ("activation_checkpointing",))) from None


def _model_parallel_group(mpu_: Any):
    """Megatron's `mpu` gives its group through `get_model_parallel_group()`; None: no
    model parallelism (data-parallel ranks hold different activations)."""
    return mpu_.get_model_parallel_group() if mpu_ is not None else None


__all__ = ["configure", "checkpoint", "checkpoint_stats", "enable", "estimate_checkpoint_bytes",
           "get_config", "held_checkpoint_bytes", "reset_peak_checkpoint_bytes"]
