"""DeepSpeed's API surface over zeromem: `import zeromem.deepspeed as deepspeed`.

A DeepSpeed training script runs unchanged but for its import lines:

    import zeromem.deepspeed as deepspeed
    from zeromem.deepspeed.accelerator import get_accelerator

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(),
        training_data=trainset, config=ds_config)

Layout as in DeepSpeed: `accelerator.get_accelerator`, `comm`, `zero.Init`,
`zero.GatheredParameters`, `checkpointing` (activation checkpointing),
`moe.utils`, `ops.adam` / `ops.adagrad` / `ops.lion` (the optimizers scripts build),
`utils` (`safe_get_full_grad` and the other partitioned-state accessors) and
`utils.zero_to_fp32` (a checkpoint as one fp32 state dict).
The native `zeromem.initialize` is unchanged; this package only translates arguments
and wraps its engine in `DeepSpeedEngine`.

Hugging Face Trainer and Accelerate import `deepspeed` themselves: call
`zeromem.deepspeed.install_as_deepspeed()` before importing them (`install.py`).
"""
from __future__ import annotations

import argparse
import json
import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from .. import initialize as _native_initialize
from . import accelerator, checkpointing, comm, moe, ops, pipe, utils, zero
from .accelerator import get_accelerator
from .engine import DeepSpeedEngine
from .init import init_distributed
from .install import install_as_deepspeed
from .pipe import PipelineEngine

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine",
           "PipelineEngine", "get_accelerator",
           "install_as_deepspeed",
           "accelerator", "comm", "zero", "checkpointing", "moe", "ops", "pipe", "utils",
           "__version__"]
__version__ = "0.16.0+zeromem"  # the DeepSpeed API level this surface follows

log = logging.getLogger("zeromem")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed` and `--deepspeed_config` arguments to `parser`."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on zeromem)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    """The one config given: `config`, `config_params` or `args.deepspeed_config`."""
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = [c for c in (config, config_params, from_args) if c is not None]
    if len(given) > 1:
        raise ValueError("a DeepSpeed config was given twice (config=, config_params= or "
                         "args.deepspeed_config); pass exactly one")
    if not given:
        raise ValueError("no DeepSpeed config: pass config= or args.deepspeed_config")
    value = given[0]
    if not isinstance(value, dict):
        return value
    return json.loads(json.dumps(value))  # a copy (Accelerate's steps_per_print inf survives)


def _groups_of(mpu: Any) -> tuple[Any, Any]:
    """(data-parallel group, model-parallel group) of Megatron's `mpu`, as DeepSpeed reads
    them; (None, None) without one: ZeRO over the whole world."""
    if mpu is None:
        return None, None
    stages = getattr(mpu, "get_pipeline_model_parallel_world_size", None)
    if stages is not None and stages() > 1:
        raise NotImplementedError(f"deepspeed.initialize: mpu has {stages()} pipeline stages; "
                                  "pipeline parallelism is not supported")
    return mpu.get_data_parallel_group(), mpu.get_model_parallel_group()


def _training_dataloader(engine: DeepSpeedEngine, training_data: Any,
                         collate_fn: Callable | None) -> DataLoader:
    """DeepSpeed's loader: micro-batches of this rank's share of a `DistributedSampler`."""
    sampler: DistributedSampler = DistributedSampler(training_data, num_replicas=engine.dp_world_size,
                                 rank=engine.engine.comm.rank)  # the data-parallel rank
    return DataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                      sampler=sampler, collate_fn=collate_fn,
                      drop_last=engine.engine.config.dataloader_drop_last)


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None
               ) -> tuple[DeepSpeedEngine, torch.optim.Optimizer | None, DataLoader | None, Any]:
    """DeepSpeed's `initialize`: (engine, optimizer, training_dataloader, lr_scheduler).

    `optimizer` may be a torch optimizer (stepped over zeromem's master shards with its
    own param groups, whose lr a scheduler built over it keeps setting) or a factory
    `params -> optimizer`; `lr_scheduler` a scheduler, or a factory `optimizer ->
    scheduler`. `training_data` gives a DataLoader with a
    `DistributedSampler` over the data-parallel ranks. `mpu`: Megatron's model-parallel
    unit (tensor parallelism; pipeline stages are refused): ZeRO shards over its
    data-parallel group, and clipping takes the norm over its model-parallel group too.
    `mesh_param` is not supported.
    """
    if model is None:
        raise ValueError("deepspeed.initialize: model= is required")
    if mesh_param is not None:
        raise NotImplementedError("deepspeed.initialize: mesh_param= is not supported")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    dp_group, mp_group = _groups_of(mpu)
    resolved = _resolve_config(args, config, config_params)
    native = _native_initialize(model, resolved, model_parameters=model_parameters,
                                optimizer=optimizer, lr_scheduler=lr_scheduler,
                                dp_group=dp_group, mp_group=mp_group)
    engine = DeepSpeedEngine(native, resolved if isinstance(resolved, dict) else None)
    loader = (_training_dataloader(engine, training_data, collate_fn)
              if training_data is not None else None)
    # no optimizer given, none returned (the engine evaluates only), as DeepSpeed's
    return engine, engine.optimizer if native.trains else None, loader, native.lr_scheduler
