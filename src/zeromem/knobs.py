"""DeepSpeed config keys that zeromem accepts but does not act on the same way.

Nothing is silently ignored: a key that would change the numbers (gradient
pre-scaling, a separate communication dtype) is refused when set away from its
default; a key that only tunes a layout or schedule zeromem always chooses for
itself is accepted with one warning saying what zeromem does instead.
"""
from __future__ import annotations

import logging

from .config import Config, ConfigError

log = logging.getLogger("zeromem")

# dotted key -> what zeromem does instead (refused when not at its default)
REFUSED = {
    "prescale_gradients": "gradients are averaged by scaling the loss by 1/(N_d x accumulation)",
    "gradient_predivide_factor": "gradients are averaged by scaling the loss by 1/(N_d x accumulation)",
    "communication_data_type": "gradients are reduced in data_types.grad_accum_dtype "
                               "(the compute dtype by default)",
    "zero_optimization.reduce_scatter": "stages 1-3 always reduce-scatter (all-to-all on gloo)",
    "zero_optimization.allgather_partitions": "updated partitions are always all-gathered",
}

# dotted key -> why zeromem does not need it (warned when not at its default)
WARNED = {
    "zero_optimization.contiguous_gradients": "gradient shards always live in one buffer",
    "zero_optimization.use_multi_rank_bucket_allreduce": "each bucket is one collective",
    "zero_optimization.round_robin_gradients": "no effect in zeromem",
    "zero_optimization.ignore_unused_parameters": "unused parameters always get zero gradients",
    "zero_optimization.stage3_model_persistence_threshold": "persistence is per fetch unit "
                                                             "(stage3_param_persistence_threshold)",
    "zero_optimization.stage3_module_granularity_threshold": "use fetch_units= in initialize",
    "zero_optimization.memory_efficient_linear": "no patched linear: none is needed",
}


def _default(config: Config, dotted: str):
    block_path, _, name = dotted.rpartition(".")
    block = config.value_at(block_path)
    return type(block).model_fields[name].default


def check_knobs(config: Config) -> None:
    """Refuse or warn about keys whose DeepSpeed meaning zeromem does not reproduce."""
    for key, instead in REFUSED.items():
        if config.value_at(key) != _default(config, key):
            raise ConfigError(f"{key} = {config.value_at(key)!r} is not supported: {instead}")
    for key, why in WARNED.items():
        if config.value_at(key) != _default(config, key):
            log.warning("%s = %r has no effect in zeromem: %s", key, config.value_at(key), why)
