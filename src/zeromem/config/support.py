"""Every config key, accounted for: read by code, refused, warned about, or gated.

Nothing is silently ignored. `READ` names the modules that act on each key (a test
checks their source mentions it). A key that would change the numbers if zeromem
honoured it the DeepSpeed way is in `REFUSED`: an error when set away from its
default. A key that only tunes a layout, schedule or log zeromem always chooses for
itself is in `WARNED`: one warning when set away from its default. Keys of whole
features zeromem does not implement are in `GATED` and refused by
`config.check_supported`. A default value is always silent. A test walks the schema
and fails for a key in none of these lists.
"""
from __future__ import annotations

import logging

from zeromem.config.schema import Config, Unsupported

log = logging.getLogger("zeromem")

# dotted key -> the modules (under src/zeromem) that act on it
READ: dict[str, tuple[str, ...]] = {
    "train_batch_size": ("config.rules",), "train_micro_batch_size_per_gpu": ("config.rules",),
    "gradient_accumulation_steps": ("config.schema",), "gradient_clipping": ("engine",),
    "steps_per_print": ("engine",), "wall_clock_breakdown": ("engine",),
    "prescale_gradients": ("engine",),  # always on: see Engine.backward
    "zeromem.timeout_s": ("__init__",), "zeromem.gather_timeout_s": ("engine",),
    "zeromem.offload_host_budget_bytes": ("offload.placement",),
    "zeromem.nvme_step_in_backward": ("offload.placement",),
    "zeromem.ignore_unknown_keys": ("config.features",),
    "optimizer.type": ("config.optimizer_blocks",), "optimizer.params": ("optim.factory",),
    "scheduler.type": ("optim.schedulers",), "scheduler.params": ("optim.schedulers",),
    "fp16.enabled": ("config.schema", "precision"), "fp16.auto_cast": ("engine",),
    **{f"fp16.{key}": ("precision",) for key in (
        "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
        "consecutive_hysteresis", "min_loss_scale")},
    "bf16.enabled": ("config.schema",),
    "bf16.bf16_master_weights_and_grads": ("config.precision_blocks", "engine"),
    "bf16.bf16_optimizer_states": ("config.precision_blocks",),
    "data_types.grad_accum_dtype": ("config.schema",),
    "data_types.buffer_dtype": ("config.schema",), "data_types.param_dtype": ("config.schema",),
    "data_types.keep_in_fp32_modules": ("module_dtypes",),
    "torch_autocast.enabled": ("engine",), "torch_autocast.dtype": ("config.precision_blocks",),
    **{f"zero_optimization.{key}": ("engine",) for key in (
        "stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
        "stage3_prefetch_bucket_size")},
    **{f"zero_optimization.{key}": ("stage3.fetch",) for key in (
        "stage3_param_persistence_threshold", "stage3_max_live_parameters",
        "stage3_max_reuse_distance")},
    "zero_optimization.sub_group_size": ("offload.placement",),
    **{f"zero_optimization.leaf_module.{key}": ("config.leaf_modules",) for key in (
        "classes", "names", "name_suffixes")},
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": ("checkpoints.model_weights",),
    **{f"zero_optimization.offload_{block}.{key}": ("offload.placement",) for block in ("param", "optimizer")
       for key in ("device", "nvme_path", "pin_memory", "buffer_count")},
    "zero_optimization.offload_param.buffer_size": ("offload.params_nvme",),
    "zero_optimization.offload_optimizer.pipeline_read": ("offload.nvme_optimizer",),
    "zero_optimization.offload_optimizer.pipeline_write": ("offload.nvme_optimizer",),
    "zero_optimization.offload_optimizer.ratio": ("offload.placement",),
    "aio.block_size": ("offload.nvme",), "aio.queue_depth": ("offload.nvme",),
    "aio.intra_op_parallelism": ("offload.nvme",), "aio.use_gds": ("offload.placement",),
    **{f"activation_checkpointing.{key}": ("activations.recompute",) for key in (
        "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
        "number_checkpoints", "synchronize_checkpoint_boundary", "profile")},
    "checkpoint.tag_validation": ("checkpoints.agreement",),
    "checkpoint.load_universal": ("engine",),
    **{f"zero_optimization.{key}": ("config.cluster", "hybrid.hierarchy") for key in (
        "mics_shard_size", "zero_hpz_partition_size", "zero_quantized_weights",
        "zero_quantized_gradients")},
    "zeromem.cluster.ranks_per_node": ("hybrid.hierarchy",),
    "zeromem.cluster.quantized_gradient_bits": ("hybrid.hierarchy",),
    "zeromem.cluster.quantization_block_size": ("hybrid.hierarchy",),
    # DeepSpeed's extras (config/extras.py)
    **{f"{block}.{key}": ("monitoring.monitors",) for block in ("csv_monitor", "tensorboard")
       for key in ("enabled", "output_path", "job_name")},
    **{f"wandb.{key}": ("monitoring.monitors",) for key in ("enabled", "group", "team", "project")},
    "comms_logger.enabled": ("monitoring.monitors",),
    **{f"comms_logger.{key}": ("monitoring.comm_log",)
       for key in ("prof_all", "prof_ops", "verbose", "debug")},
    "flops_profiler.enabled": ("monitoring.monitors",),
    **{f"flops_profiler.{key}": ("monitoring.flops",) for key in (
        "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed",
        "output_file")},
    **{key: ("monitoring.monitors",) for key in (
        "timers.throughput.enabled", "timers.throughput.synchronized", "dump_state", "memory_breakdown",
        "log_level")},
    "dataloader_drop_last": ("deepspeed.__init__",),
}

# dotted key -> the zeromem feature (config.OUT_OF_SCOPE / NOT_BUILT) it turns on
GATED: dict[str, str] = {
    **{f"zero_optimization.{key}": "zeropp" for key in (
        "zero_quantized_nontrainable_weights", "zeropp_loco_param")},
    "zero_optimization.mics_hierarchical_params_gather": "mics",
    "zero_optimization.elastic_checkpoint": "elastic_checkpoint",
}

# dotted key -> what zeromem does instead (refused when not at its default)
REFUSED = {
    "gradient_predivide_factor": "gradients are averaged by scaling the loss by 1/(N_d x accumulation)",
    "communication_data_type": "gradients are reduced in data_types.grad_accum_dtype "
                               "(the compute dtype by default)",
    "zero_optimization.reduce_scatter": "stages 1-3 always reduce-scatter (all-to-all on gloo)",
    "zero_optimization.allgather_partitions": "updated partitions are always all-gathered",
    "fp16.fp16_master_weights_and_grads": "master weights and gradients are always fp32; fp16 "
                                          "masters would change every update",
    "bf16.immediate_grad_update": "gradients accumulate in data_types.grad_accum_dtype; set it "
                                  "to 'fp32' to accumulate each micro-step in fp32",
    "zero_optimization.load_from_fp32_weights": "checkpoints always restore the fp32 masters; "
                                                "masters rebuilt from 16-bit weights would lose "
                                                "precision",
    "checkpoint.use_node_local_storage": "checkpoints need one directory every rank can read "
                                         "(shared storage); per-node copies could not be "
                                         "loaded back",
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
    "zero_optimization.offload_optimizer.fast_init": "NVMe optimizer state is always "
                                                     "initialised tile by tile",
    "zero_optimization.offload_param.max_in_cpu": "NVMe parameters are staged only through "
                                                  "offload_param.buffer_count buffers",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "parameters are always "
                                                                "fetched by all-gather",
    "zero_optimization.override_module_apply": "Module.apply always sees whole parameters "
                                               "under zeromem.Init",
    "zero_optimization.legacy_stage1": "there is one stage-1 implementation",
    "zero_optimization.pipeline_loading_checkpoint": "there is no pipeline parallelism",
    "zero_optimization.log_trace_cache_warnings": "stage-3 messages go to the 'zeromem' "
                                                  "logger; set its level instead",
    "checkpoint.parallel_write.pipeline_stage": "there is no pipeline parallelism; each rank "
                                                "writes its own files",
    "zero_allow_untested_optimizer": "client optimizers are accepted without it: elementwise "
                                     "ones step the flat shards exactly, those that need whole "
                                     "parameters are refused, others are warned about",
    "zero_force_ds_cpu_optimizer": "offloaded shards are always stepped by torch.optim",
    "aio.single_submit": "requests are split into chunks of aio.block_size x queue_depth "
                         "bytes for a thread pool",
    "aio.overlap_events": "the thread pool always overlaps requests",
    "torch_autocast.lower_precision_safe_modules": "every gradient is reduced in its own dtype "
                                                   "(fp32 over fp32 parameters); DeepSpeed "
                                                   "reduces these modules' in bfloat16",
}


def non_default(config: Config, dotted: str) -> bool:
    """Whether the key at `dotted` is set away from its default (False under an absent block)."""
    block_path, _, name = dotted.rpartition(".")
    block = config.value_at(block_path) if block_path else config
    if block is None:
        return False
    field = type(block).model_fields[name]
    return getattr(block, name) != field.get_default(call_default_factory=True)


def check_supported_keys(config: Config) -> None:
    """Refuse or warn about keys whose DeepSpeed meaning zeromem does not reproduce."""
    for key, instead in REFUSED.items():
        if non_default(config, key):
            raise Unsupported(key, None, instead, config.value_at(key))
    for key, why in WARNED.items():
        if non_default(config, key):
            log.warning("%s = %r has no effect in zeromem: %s", key, config.value_at(key), why)
