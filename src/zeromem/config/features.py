"""DeepSpeed's features that the schema does not model: accepted while off, refused when on.

A DeepSpeed config may carry any of DeepSpeed's feature blocks. zeromem's rule:

- a block that leaves its feature off (`"enabled": false`, an empty block, a default
  value) is accepted: DeepSpeed would not run it either;
- a feature the config turns on is either implemented (its block is modelled in
  `config.extras` or `config.schema` and read by the engine) or refused here with an
  `Unsupported` error naming the key, the feature and why; never silently ignored;
- a few knobs that only tune a layout zeromem chooses itself are accepted on with a
  warning (`effect="warn"`), as `config.support.WARNED` does for the schema's keys;
- a top-level key that is not DeepSpeed's at all stays an error ("did you mean ...?"),
  unless the config opts out with `"zeromem": {"ignore_unknown_keys": true}` (DeepSpeed
  itself ignores unknown top-level keys): then each is dropped with a warning naming it.

`take_features` runs on the raw dict before validation (`Config.load`); it returns the
dict without the blocks it accepted, and those blocks, kept on the Config as `inert`.
"""
from __future__ import annotations

import copy
import difflib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

from zeromem.config.rules import ConfigError, Unsupported

log = logging.getLogger("zeromem")


# ---------------------------------------------------------------- when a block is on

def enabled(default: bool = False) -> Callable[[str, Any], bool]:
    """A block that is on when its "enabled" key is true (DeepSpeed's usual switch)."""

    def active(key: str, block: Any) -> bool:
        block = _object(key, block)
        near = [k for k in block if k != "enabled"
                and difflib.get_close_matches(k, ["enabled"], n=1, cutoff=0.8)]
        if near:  # "enable": true would read as off: a silent no-op
            raise ConfigError(f"unknown key {near[0]!r} at {key}.{near[0]}; did you mean 'enabled'?")
        value = block.get("enabled", default)
        if not isinstance(value, bool):
            raise ConfigError(f"{key}.enabled must be true or false, got {value!r}")
        return value

    return active


def present(key: str, block: Any) -> bool:
    """A block that is on whenever it says anything (DeepSpeed reads its presence)."""
    return block not in (None, {}, [], False)


def differs_from(default: Any) -> Callable[[str, Any], bool]:
    """A plain value that is on when it differs from DeepSpeed's default."""
    return lambda key, value: value != default or type(value) is not type(default)


def _object(key: str, block: Any) -> dict:
    if not isinstance(block, dict):
        raise ConfigError(f"{key} must be an object, got {block!r}")
    return block


def _compression_on(key: str, block: Any) -> bool:
    """Any technique of compression_training switched on (its shared_parameters.enabled;
    layer_reduction has its own enabled)."""
    for name, technique in _object(key, block).items():
        technique = _object(f"{key}.{name}", technique)
        switch = technique.get("shared_parameters", technique)
        if enabled()(f"{key}.{name}", switch):
            return True
    return False


def _deepcompile_on(key: str, block: Any) -> bool:
    return _object(key, block).get("deepcompile", False) is not False


def _autotp_on(key: str, block: Any) -> bool:
    size = _object(key, block).get("autotp_size", 0)
    if isinstance(size, bool) or not isinstance(size, int):
        raise ConfigError(f"{key}.autotp_size must be an integer, got {size!r}")
    return size > 1


# ---------------------------------------------------------------- the registry

@dataclass(frozen=True)
class Feature:
    """A DeepSpeed feature (or setting) at dotted `key` that the schema does not model."""

    key: str
    name: str  # DeepSpeed's name for it
    reason: str  # why zeromem does not run it, and what to use instead
    active: Callable[[str, Any], bool] = enabled()
    effect: Literal["refuse", "warn"] = "refuse"


FEATURES: tuple[Feature, ...] = (
    Feature("autotuning", "Autotuning", "a mode of DeepSpeed's launcher (`deepspeed --autotuning`) "
            "that runs trial jobs; `zeromem launch` runs none: `zeromem plan` recommends a stage, "
            "offload and batch from the model and hardware"),
    Feature("compression_training", "DeepSpeed Compression (XTC, ZeroQuant, pruning, layer "
            "reduction)", "it rewrites the model's layers (deepspeed.compression."
            "init_compression) and schedules the compression from the engine; zeromem trains "
            "the model as given", _compression_on),
    Feature("data_efficiency", "Data Efficiency (curriculum learning, random-LTD)",
            "it changes which samples and tokens each step trains on through DeepSpeed's data "
            "sampler and layer hooks; zeromem's loader is a plain DistributedSampler"),
    Feature("curriculum_learning", "curriculum learning (legacy)", "it truncates each batch's "
            "sequence length on a schedule through the engine; zeromem does not change batches"),
    Feature("progressive_layer_drop", "Progressive Layer Dropping", "the engine hands the model "
            "a keep probability every step (progressive_layer_drop.get_state()); zeromem's engine "
            "has none to hand"),
    Feature("sparse_attention", "Sparse Attention", "its block-sparse attention kernels "
            "(deepspeed.ops.sparse_attention, Triton) are not part of zeromem", present),
    Feature("quantize_training", "MoQ (mixture-of-quantization training)", "it quantizes the "
            "weights on a schedule during training; zeromem keeps fp32 master weights"),
    Feature("eigenvalue", "eigenvalue-guided quantization (MoQ)", "it runs power iterations on "
            "layer Hessians during training; zeromem does not"),
    # before the block's own entry, which takes the whole block
    Feature("hybrid_engine.inference_tp_size", "Hybrid Engine tensor-parallel generation",
            "it shards the generating model over inference_tp_size ranks with "
            "DeepSpeed-Inference kernels; zeromem has neither", differs_from(1)),
    Feature("hybrid_engine", "Hybrid Engine (DeepSpeed-Chat RLHF)", "generation runs as "
            "without it, on the training engine's ZeRO-3 gathers and the model's own kernels "
            "(DeepSpeed swaps in its inference kernels to generate faster); training is the "
            "same", effect="warn"),
    Feature("amp", "NVIDIA Apex AMP", "Apex is not used; set fp16.enabled or bf16.enabled"),
    Feature("elasticity", "Elastic training", "the batch size and world size are chosen by "
            "DeepSpeed's elastic agent; zeromem runs the batch as configured (its checkpoints "
            "resume at any world size)"),
    Feature("nebula", "Nebula checkpointing", "an Azure checkpoint service; zeromem writes its "
            "checkpoints itself"),
    Feature("datastates_ckpt", "DataStates asynchronous checkpointing", "zeromem's checkpoints "
            "are written by zeromem (atomic, any world size)",
            lambda key, value: value is not None and value is not False),
    Feature("weight_quantization", "weight quantization at initialization", "zeromem keeps "
            "weights in the compute dtype", present),
    Feature("compile", "DeepCompile", "its compiler passes work on DeepSpeed's engine internals; "
            "call torch.compile on the model instead (zeromem trains compiled modules)",
            _deepcompile_on),
    Feature("tensor_parallel", "AutoTP tensor parallelism", "zeromem does not shard the model's "
            "layers itself; pass a tensor-parallel model and its group as mp_group= to "
            "zeromem.initialize", _autotp_on),
    Feature("expert_parallel", "AutoEP expert parallelism", "zeromem has no expert parallelism"),
    Feature("pipeline", "pipeline parallelism (PipelineModule)", "zeromem has no pipeline "
            "engine", present),
    Feature("comet", "Comet monitor", "zeromem's monitors are csv_monitor, tensorboard and wandb"),
    Feature("sequence_parallel_size", "Ulysses sequence parallelism", "zeromem has no sequence "
            "parallelism", differs_from(1)),
    Feature("seq_parallel_communication_data_type", "Ulysses sequence parallelism",
            "zeromem has no sequence parallelism", differs_from("fp32")),
    Feature("use_data_before_expert_parallelism", "expert-parallel group layout", "zeromem has no "
            "expert parallelism", differs_from(False)),
    Feature("sparse_gradients", "sparse (CSR) embedding gradients", "zeromem reduces an "
            "nn.Embedding(sparse=True) gradient dense: the same update, more bytes moved",
            differs_from(False), effect="warn"),
    Feature("gradient_allreduce_op", "gradient summation", "gradients are averaged (loss scaled "
            "by 1/(N_d x accumulation)); summing would change every update", differs_from("mean")),
    Feature("disable_allgather", "broadcast instead of all-gather", "updated partitions are "
            "always all-gathered", differs_from(False)),
    Feature("graph_harvesting", "CUDA graph harvesting", "zeromem does not capture CUDA graphs",
            differs_from(False)),
    Feature("managed_gradient_accumulation", "client-managed accumulation boundaries",
            "the engine steps every gradient_accumulation_steps micro-steps; it does not take "
            "the boundary from the client", differs_from(True)),
    Feature("disable_python_gc", "Python GC control", "zeromem leaves Python's automatic "
            "garbage collection as it is: call gc.disable() yourself, and gc.collect() (DeepSpeed's "
            "engine.collect_python_gc()) where your loop allows", differs_from(False), "warn"),
    Feature("vocabulary_size", "vocabulary alignment check", "DeepSpeed reads it only to warn "
            "that a vocabulary size not a multiple of 8 may use tensor cores poorly: pad the "
            "embedding", lambda key, value: isinstance(value, int) and value % 8 != 0, "warn"),
    # nested in blocks the schema models
    Feature("zero_optimization.compute_grad_norm", "skipping the gradient norm", "the global "
            "gradient norm is computed every step: a step whose gradients hold inf or nan is "
            "skipped by it, and get_global_grad_norm() reports it (one all-reduce of a scalar)",
            differs_from(True), "warn"),
    Feature("zero_optimization.parameter_alignment", "16-byte parameter alignment", "zeromem "
            "packs each flat group's parameters end to end (torch's kernels take unaligned views); "
            "the padding would only add memory", differs_from(False), "warn"),
    Feature("zero_optimization.offload_optimizer.super_offload", "SuperOffload", "it schedules "
            "ZeRO-Offload's CPU step speculatively on superchips (CUDA only); its updates are "
            "ZeRO-Offload's, which zeromem runs with offload_optimizer.device cpu",
            differs_from(False), "warn"),
    Feature("zero_optimization.offload_optimizer.cpuadam_cores_perc", "SuperOffload's CPU cores",
            "the CPU step runs on torch's intra-op threads (torch.set_num_threads)",
            differs_from(0.8), "warn"),
    Feature("zero_optimization.zenflow", "ZenFlow", "it updates the important gradient columns "
            "on the GPU and the rest asynchronously on the CPU; zeromem's offload steps every "
            "element every step", present),
    Feature("zero_optimization.allgather_sequential", "sequential stage-3 all-gather",
            "stage 3 gathers one fetch unit at a time already", differs_from(False), "warn"),
    Feature("zero_optimization.stage3_allgather_sequential", "sequential stage-3 all-gather",
            "stage 3 gathers one fetch unit at a time already", differs_from(False), "warn"),
    Feature("zero_optimization.enable_sanity_checks", "ZeRO sanity checks", "zeromem's own checks "
            "always run", differs_from(False), "warn"),
    Feature("zero_optimization.save_muon_momentum_buffer_in_memory", "Muon with NVMe offload",
            "zeromem refuses Muon with NVMe optimizer offload, the only case it is for",
            differs_from(False), "warn"),
    Feature("bf16.check_grad_overflow", "unchecked bf16 steps", "a step whose gradient norm is "
            "not finite is always skipped", differs_from(True), "warn"),
    Feature("optimizer.legacy_fusion", "legacy fused fp16 optimizer", "the optimizer always "
            "steps the fp32 masters", differs_from(False), "warn"),
    Feature("checkpoint.writer", "pluggable checkpoint writers", "zeromem writes its own "
            "checkpoint files (safetensors shards, atomic)", present),
    Feature("checkpoint.checkpoint_serialization", "checkpoint serialization switch",
            "zeromem's checkpoint files are safetensors", differs_from(True), "warn"),
)
BY_KEY = {feature.key: feature for feature in FEATURES}
TOP_LEVEL = tuple(f.key for f in FEATURES if "." not in f.key)


# ---------------------------------------------------------------- the pass before validation

def take_features(data: dict, known: Iterable[str]) -> tuple[dict, dict[str, Any]]:
    """`data` without the DeepSpeed feature blocks it leaves off, and those blocks.

    Raises Unsupported for a feature turned on; warns for an "on" that only tunes what
    zeromem decides itself. `known` are the schema's top-level keys (unknown others are
    errors later, or dropped here when the config opts out).
    """
    known = set(known)
    data = _drop_dotted(copy.copy(data), known)
    inert: dict[str, Any] = {}
    for feature in FEATURES:
        *parents, leaf = feature.key.split(".")
        holder: Any = data
        for name in parents:
            holder = holder.get(name) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or leaf not in holder:
            continue
        value = holder[leaf]
        if feature.active(feature.key, value):
            if feature.effect == "refuse":
                raise Unsupported(feature.key, feature.name, feature.reason,
                                  value if not isinstance(value, (dict, list)) else None)
            log.warning("%s = %r has no effect in zeromem: %s", feature.key, value, feature.reason)
        inert[feature.key] = value
        _without(data, parents, leaf)
    return _drop_unknown(data, known), inert


def _drop_dotted(data: dict, known: set[str]) -> dict:
    """Top-level keys written as a dotted path into a known block ("zero_optimization.
    reduce_bucket_size" = 0.9 * hidden_size**2: TRL's reference-model configs) are dropped
    with a warning: DeepSpeed ignores every unknown top-level key, so its runs of those
    recipes never applied them, and a run here is then configured as it was there."""
    for key in [k for k in data if "." in k and k.split(".")[0] in known]:
        log.warning("config key %r = %r ignored, as DeepSpeed ignores it: a nested key is "
                    "set inside its block", key, data.pop(key))
    return data


def _without(data: dict, parents: list[str], leaf: str) -> None:
    """Remove `leaf` under the nested `parents` of `data`, copying each dict on the way."""
    holder = data
    for name in parents:
        holder[name] = dict(holder[name])
        holder = holder[name]
    del holder[leaf]


def _drop_unknown(data: dict, known: set[str]) -> dict:
    """With `"zeromem": {"ignore_unknown_keys": true}`: drop the unknown top-level keys."""
    own = data.get("zeromem")
    if not (isinstance(own, dict) and own.get("ignore_unknown_keys") is True):
        return data
    unknown = [key for key in data if key not in known]
    for key in unknown:
        log.warning("config key %r is not DeepSpeed's nor zeromem's; ignored as "
                    "zeromem.ignore_unknown_keys says", key)
        del data[key]
    return data
