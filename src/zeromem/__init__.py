"""zeromem: the ZeRO family of memory optimizations for PyTorch, small enough to read.

    engine = zeromem.initialize(model, "ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from zeromem import checkpointing
from zeromem.activations.recompute import checkpoint
from zeromem.comm import Comm
from zeromem.config.schema import Config, ConfigError
from zeromem.distributed import LIFECYCLE, Runtime, default_store, ensure_process_group, shutdown
from zeromem.checkpoints.consolidate import CheckpointError
from zeromem.engine import Engine
from zeromem.hybrid.hierarchy import node_layout
from zeromem.config.support import check_supported_keys
from zeromem.offload.nvme import OffloadError
from zeromem.optim.factory import client_optimizer_factory
from zeromem.stage3 import partitioned_init
from zeromem.stage3.partitioned_init import GatheredParameters, Init, Partitions
from zeromem.rank_check import RankMismatchError, check_ranks_agree
from zeromem.lockstep import RankDivergenceError
from zeromem.module_state import refuse_untakeable
from zeromem.training_state import SchedulerArg

__all__ = ["initialize", "Engine", "Config", "ConfigError", "CheckpointError", "checkpoint",
           "checkpointing", "Init", "GatheredParameters", "OffloadError", "RankMismatchError",
           "RankDivergenceError", "shutdown"]
__version__ = "0.1.0"
log = logging.getLogger("zeromem")


# What initialize makes (flat buffers the parameters then view, masters, shards) is what
# training uses: under a caller's torch.inference_mode it would be inference tensors,
# which autograd refuses to save and in-place updates refuse to change.
@torch.inference_mode(False)
def initialize(model: nn.Module, config: dict | str | Path | Config,
               model_parameters: Iterable | None = None,
               optimizer: Callable[[list[dict]], torch.optim.Optimizer] | torch.optim.Optimizer
               | None = None,
               lr_scheduler: SchedulerArg = None,
               dp_group: dist.ProcessGroup | None = None,
               fetch_units: tuple[type, ...] = (),
               mp_group: dist.ProcessGroup | None = None,
               partitions: Partitions | None = None) -> Engine:
    """Wrap `model` for ZeRO training as `config` (DeepSpeed's JSON format) says.

    Creates the default process group from torchrun's environment when none
    exists; with neither, trains as world size 1. `optimizer` is an optional
    factory `param_groups -> torch.optim.Optimizer` applied to the engine's fp32
    master shards, or an optimizer built over the model's parameters (as for DDP or
    FSDP2), whose class, settings and param groups are then applied to them; step the
    engine, not that optimizer. By default the config's `optimizer` block is used.
    `fetch_units` (stage 3): module classes whose instances are gathered as one
    unit (e.g. a transformer block); by default repeated blocks, small neighbours merged
    (stage3/units.py; the choice is `engine.fetch_unit_report`).
    `mp_group`: the tensor (model) parallel group, so gradient clipping uses the
    whole model's norm; by default the activation-checkpointing `mp_group`.
    `partitions`: where `zeromem.Init` put the model's shards, and where
    `GatheredParameters` will find the engine's; by default the one both use by default.
    """
    refuse_untakeable(model)  # on every rank, before anything reads a shape
    optimizer, model_parameters = client_optimizer_factory(optimizer, model_parameters)
    partitions = partitioned_init.DEFAULT if partitions is None else partitions
    hidden = _hidden_size(model)  # resolves the hidden-size "auto" values, as HF does
    config = _in_models_precision(config, model)
    first = Config.load(config, hidden_size=hidden)
    ensure_process_group(first.zeromem.timeout_s)
    world = dist.get_world_size() if dist.is_initialized() else 1
    runtime = Runtime.from_env(dp_group, first.zeromem.gather_timeout_s)  # env read here only
    layout = node_layout(first, world, runtime.ranks_per_node)  # nodes split the ledger
    comm = Comm(dp_group, default_store(), layout)
    cfg = Config.load(config, world_size=comm.world_size, hidden_size=hidden)
    check_supported_keys(cfg)
    check_ranks_agree(cfg, model, comm, partitions)  # before any collective that a mismatch would hang
    engine = Engine(model, cfg, comm, model_parameters, optimizer, lr_scheduler, tuple(fetch_units),
                    mp_group, partitions, runtime)
    LIFECYCLE.register(engine)  # closed at exit / SIGTERM unless closed before
    return engine


def _in_models_precision(config: dict | str | Path | Config, model: nn.Module
                         ) -> dict | str | Path | Config:
    """`config`, with the bf16 (fp16) block on when it turns on neither and every trainable
    floating parameter (of a frozen model: every one) is bfloat16 (float16): a model loaded in 16 bits (HF's
    `torch_dtype=torch.bfloat16` without `--bf16`) trains in its own dtype, over fp32
    masters, as DeepSpeed keeps it; cast to fp32 it would take twice the memory, and fail
    on 16-bit inputs. fp16 gets dynamic loss scaling, which DeepSpeed would leave out."""
    floating = [p for p in model.parameters() if p.is_floating_point()]
    dtypes = {p.dtype for p in [p for p in floating if p.requires_grad] or floating}
    block = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtypes.pop()) \
        if len(dtypes) == 1 else None
    if block is None:
        return config
    data, _ = Config.read(config)
    if any(isinstance(data.get(k), dict) and data[k].get("enabled") is True
           for k in ("fp16", "bf16", "bfloat16")):
        return config
    log.warning("the model's trainable parameters are %s and the config turns on neither fp16 "
                "nor bf16: training in %s over fp32 masters, as if \"%s\": {\"enabled\": true}",
                "bfloat16" if block == "bf16" else "float16", block, block)
    given = data[block] if isinstance(data.get(block), dict) else {}
    return {k: v for k, v in data.items() if k != "bfloat16"} | {block: {**given, "enabled": True}}


def _hidden_size(model: nn.Module) -> int | None:
    """A Hugging Face model's hidden size (the largest of `hidden_sizes` where it has
    several), which HF's Trainer fills the config's hidden-size "auto" values from; None
    for other models, whose "auto" values are refused by name."""
    config = getattr(model, "config", None)
    sizes = getattr(config, "hidden_sizes", None)
    size = max(sizes) if sizes else getattr(config, "hidden_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
