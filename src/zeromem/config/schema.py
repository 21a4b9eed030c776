"""DeepSpeed-compatible JSON configuration: strict pydantic models (REFERENCE.md section 2).

`Config.load()` is the one entry point. It reads a dict, JSON file or Config; maps legacy
key names (warning where DeepSpeed deprecated them); resolves Hugging Face "auto" values
(derived, or zeromem's default for ZeRO sizes; rules.py) and rejects the rest; validates
every block with unknown keys forbidden ("did you mean ...?"); resolves the batch triple
train = micro x gas x world_size once the world size is known; and refuses features in
`NOT_BUILT`.

Defaults are DeepSpeed 0.19.8's *code* defaults, which differ from its docs in places
(stage3_prefetch_bucket_size 5e7) and from older releases (gradient_clipping 1.0, 0.0
before its PR 8068; offload pin_memory true). Integer fields accept
whole floats such as 5e8. Every failure is a `ConfigError` naming the dotted key.

This module holds the block models, `Config.load`, `describe` and the feature gate; the
rules applied around them (error messages, key renames, "auto", the batch triple) live in
`zeromem.config.rules`, and `ConfigError` and `resolve_batch` are re-exported from here.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
from typing import Annotated, Any, Callable, ClassVar, Literal

import torch
from pydantic import (BaseModel, BeforeValidator, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from zeromem.config.cluster import ClusterConfig, check_zeropp
from zeromem.config import features
from zeromem.config.extras import Extras
from zeromem.config.leaf_modules import LeafModuleConfig
from zeromem.config.precision_blocks import (DTYPES, BF16Config, DataTypesConfig, FP16Config,
                                             TorchAutocastConfig, check_bf16_masters)
from zeromem.config.optimizer_blocks import (OptimizerConfig, SchedulerConfig,  # noqa: F401 (re-exported)
                                             _optimizer_params_model, _scheduler_params_model)
from zeromem.config.rules import (AIO_RENAMED, BATCH_KEYS, TOP_LEVEL_RENAMED, ZERO_RENAMED,
                                  ConfigError, Unsupported, humanise, map_cpu_offload,
                                  resolve_auto, resolve_batch)
from zeromem.config.types import (NUMBER_LIMIT, Bool, Dtype, Float, Int,  # noqa: F401 (re-exported)
                                  OffloadDevice, StepsPerPrint, _Block, _not_bool, _numeric)

logger = logging.getLogger("zeromem")

# Features the engine cannot run yet; Config.load rejects configs that use them.
# Remove a name here when the feature lands.
NOT_BUILT: frozenset[str] = frozenset()
# DeepSpeed features zeromem does not plan to implement; rejected rather than ignored.
OUT_OF_SCOPE: frozenset[str] = frozenset({"zeropp", "mics", "elastic_checkpoint"})
class _OffloadBlock(_Block):
    """Keys shared by the two offload blocks."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None  # directory on NVMe; required when device is "nvme"
    pin_memory: Bool = True  # page-locked host buffers (with CUDA): faster copies; DeepSpeed 0.19.8's default

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadBlock:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device 'nvme' needs nvme_path")
        return self


class OffloadOptimizerConfig(_OffloadBlock):
    """`zero_optimization.offload_optimizer`: where optimizer state and its step live."""

    buffer_count: Int = Field(4, ge=1)  # NVMe swap buffers (Adam needs >= 4: param, grad, m, v)
    pipeline_read: Bool = True  # overlap reading the next tile with the step (DeepSpeed: off)
    pipeline_write: Bool = True  # overlap writing the previous tile with the step (DeepSpeed: off)
    fast_init: Bool = False  # fast optimizer initialisation for NVMe
    ratio: Float = Field(1.0, gt=0, le=1)  # fraction of optimizer state offloaded (< 1: stage 3)


class OffloadParamConfig(_OffloadBlock):
    """`zero_optimization.offload_param`: where partitioned parameters live (stage 3)."""

    buffer_count: Int = Field(5, ge=1)  # NVMe parameter buffers
    buffer_size: Int = Field(100_000_000, ge=1)  # elements per NVMe parameter buffer
    max_in_cpu: Int = Field(1_000_000_000, ge=0)  # parameter elements kept in CPU with NVMe


class ZeroConfig(_Block):
    """`zero_optimization`: which model states are partitioned, and the buffer sizes."""

    _section = "zero_optimization"
    _renamed = ZERO_RENAMED

    # 0 off; 1 optimizer states; 2 + gradients; 3 + parameters (true is not stage 1)
    stage: Annotated[Literal[0, 1, 2, 3], BeforeValidator(_not_bool)] = 0
    contiguous_gradients: Bool = True  # copy grads into a contiguous buffer as produced
    reduce_scatter: Bool = True  # reduce-scatter grads instead of all-reduce
    reduce_bucket_size: Int = Field(500_000_000, ge=1)  # elements reduced per bucket
    use_multi_rank_bucket_allreduce: Bool = True  # merge ranks' buckets into one all-reduce
    allgather_partitions: Bool = True  # all-gather updated params rather than broadcasts
    allgather_bucket_size: Int = Field(500_000_000, ge=1)  # elements all-gathered per bucket
    overlap_comm: Bool | None = None  # overlap grad reduction with backward; None = stage == 3
    load_from_fp32_weights: Bool = True  # initialise fp32 masters from the checkpoint's copy
    elastic_checkpoint: Bool = False  # no longer supported by DeepSpeed
    # elements per optimizer-step tile; 0 (Axolotl's ZeRO-3 configs): the smallest tiles, as
    # in DeepSpeed, where each parameter is then a sub-group of its own
    sub_group_size: Int = Field(1_000_000_000, ge=0)
    stage3_prefetch_bucket_size: Int = Field(50_000_000, ge=0)  # param elements fetched ahead
    stage3_param_persistence_threshold: Int = Field(100_000, ge=0)  # smaller params stay whole
    stage3_model_persistence_threshold: Int = Field(sys.maxsize, ge=0)  # cap on whole elements
    stage3_max_live_parameters: Int = Field(1_000_000_000, ge=0)  # resident elements per GPU
    stage3_max_reuse_distance: Int = Field(1_000_000_000, ge=0)  # keep params reused this soon
    stage3_gather_16bit_weights_on_model_save: Bool = False  # gather 16-bit weights on save
    stage3_module_granularity_threshold: Int = Field(0, ge=0)  # fuse fine modules into one fetch
    stage3_use_all_reduce_for_fetch_params: Bool = False  # fetch params with all-reduce
    ignore_unused_parameters: Bool = True  # stage 2: tolerate params that get no grad
    round_robin_gradients: Bool = False  # stage 1/2 offload: parallel grad copies to CPU
    zero_hpz_partition_size: Int = Field(1, ge=1)  # ZeRO++ hpZ secondary group size
    zero_quantized_weights: Bool = False  # ZeRO++ qwZ: int8 weight all-gather
    zero_quantized_nontrainable_weights: Bool = False  # store frozen weights quantized
    zero_quantized_gradients: Bool = False  # ZeRO++ qgZ: quantized grad all-to-all
    zeropp_loco_param: dict[str, Any] | None = None  # ZeRO++ LoCo {err_beta, reset_T}
    mics_shard_size: Int = Field(-1, ge=-1)  # MiCS shard group size; -1 = off
    mics_hierarchical_params_gather: Bool = False  # MiCS hierarchical gather
    memory_efficient_linear: Bool = True  # stage-3 linear implementation
    override_module_apply: Bool = True  # gather params inside Module.apply
    pipeline_loading_checkpoint: Bool = False
    log_trace_cache_warnings: Bool = False
    legacy_stage1: Bool = False
    offload_param: OffloadParamConfig | None = None  # stage 3 only
    offload_optimizer: OffloadOptimizerConfig | None = None  # stages 1-3
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)  # stage 3

    @model_validator(mode="before")
    @classmethod
    def _map_cpu_offload(cls, data: Any) -> Any:
        """Map DeepSpeed's deprecated boolean offload keys onto the offload blocks."""
        return map_cpu_offload(data)

    @model_validator(mode="after")
    def _check_stage_rules(self) -> ZeroConfig:
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3  # DeepSpeed's stage-dependent default
            self._derived.add("overlap_comm")
        if self.offload_optimizer and self.offload_optimizer.ratio < 1 and self.stage != 3:
            raise ValueError(f"offload_optimizer.ratio < 1 requires stage 3, "
                             f"got stage {self.stage}")
        if self.offload_param_device != "none" and self.stage != 3:
            # DeepSpeed reads it only at stage 3 and ignores it below (DeepSpeed-Chat's
            # `--offload` and Accelerate's plugin write it at any stage)
            logger.warning("zero_optimization.offload_param = %s has no effect at stage %s: "
                           "only stage 3 partitions, and so offloads, parameters",
                           self.offload_param.model_dump(exclude_unset=True)
                           if self.offload_param else None, self.stage)
            self.offload_param = None
        check_zeropp(self)  # hpZ / qwZ / qgZ / hybrid sharding vs the stage (config/cluster.py)
        return self

    @property
    def offload_optimizer_device(self) -> str:
        """"none", "cpu" or "nvme"."""
        return self.offload_optimizer.device if self.offload_optimizer else "none"

    @property
    def offload_param_device(self) -> str:
        """"none", "cpu" or "nvme"."""
        return self.offload_param.device if self.offload_param else "none"


class AioConfig(_Block):
    """`aio`: asynchronous NVMe I/O settings."""

    _section = "aio"
    _renamed = AIO_RENAMED

    block_size: Int = Field(1_048_576, ge=1)  # bytes per I/O request
    queue_depth: Int = Field(8, ge=1)  # libaio queue depth
    intra_op_parallelism: Int = Field(1, ge=1)  # I/O threads per operation
    single_submit: Bool = False  # submit requests one by one instead of batched
    overlap_events: Bool = True  # submit without waiting for earlier requests
    use_gds: Bool = False  # GPUDirect Storage (CUDA only)


class ActivationCheckpointingConfig(_Block):
    """`activation_checkpointing`: ZeRO-R partitioned activation checkpoints."""

    partition_activations: Bool = False  # shard checkpoint inputs across the MP group
    cpu_checkpointing: Bool = False  # move partitioned checkpoints to CPU
    contiguous_memory_optimization: Bool = False  # copy checkpoints into one buffer
    number_checkpoints: Int | None = Field(None, ge=1)  # sizes that buffer
    synchronize_checkpoint_boundary: Bool = False  # device sync at each checkpoint
    profile: Bool = False  # log forward/backward time per checkpoint


class ParallelWriteConfig(_Block):
    """`checkpoint.parallel_write`."""

    pipeline_stage: Bool = False  # each pipeline stage writes its own part


class CheckpointConfig(_Block):
    """`checkpoint`: checkpoint save/load behaviour."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"  # check tags agree across ranks
    load_universal: Bool = False  # resume from latest_universal (ds_to_universal) before latest
    use_node_local_storage: Bool = False  # every node writes its own copy
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _normalise_case(cls, value: Any) -> Any:
        return value.capitalize() if isinstance(value, str) else value


# `zeromem.offload_host_budget_bytes`'s default. 128 MiB, not 64: at 64 the issue-16 model at
# W=2048 cut its optimizer into 130 sub-groups of 1 MB requests, whose bookkeeping and I/O
# submissions cost the step 1.27x its bound (1.20x at 128); 256 MiB (1.14x) would hold more
# than the W=1024 model's pool needs, so host memory would grow with the model from there
# (README, "NVMe offload")
OFFLOAD_HOST_BUDGET_BYTES = 128 * 2**20


class TimeoutsConfig(_Block):
    """`zeromem`: zeromem's own keys, not DeepSpeed's: how long a rank waits for the others,
    and how much host memory NVMe offload may use.

    The environment variables ZEROMEM_TIMEOUT_S / ZEROMEM_GATHER_TIMEOUT_S, when set,
    override the timeouts (an operator can change them without editing the job's file).
    """

    timeout_s: Float = Field(600.0, gt=0)  # a collective waiting longer fails (process group timeout)
    gather_timeout_s: Float = Field(300.0, ge=0)  # a stage-3 gather waiting longer is a divergence; 0 = off
    # host bytes per rank for NVMe offload's buffers (optimizer and parameter pools); sizes
    # sub_group_size and offload_optimizer.buffer_count unless those are set (offload/budget.py)
    offload_host_budget_bytes: Int = Field(OFFLOAD_HOST_BUDGET_BYTES, ge=1)
    # fp32 stage 3 with optimizer and parameters on NVMe: the step begins in the boundary
    # backward (offload/backward_step.py; with clipping, while the last step was not clipped),
    # at twice the disk for states and shards
    nvme_step_in_backward: Bool = True
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)  # nodes, ZeRO++ quantization
    ignore_unknown_keys: Bool = False  # drop top-level keys neither DeepSpeed's nor ours (warned)


# ---------------------------------------------------------------- features not built

def _activation_checkpointing_key(config: Config) -> str | None:
    block = config.activation_checkpointing
    changed = [n for n, f in type(block).model_fields.items() if getattr(block, n) != f.default]
    return f"activation_checkpointing.{changed[0]}" if changed else None


def _zeropp_key(config: Config) -> str | None:
    # hpZ, qwZ and qgZ are built (hybrid/hierarchy.py); LoCo and quantized frozen weights are not
    zero = config.zero_optimization
    names = ("zero_quantized_nontrainable_weights", "zeropp_loco_param")
    used = [name for name in names if getattr(zero, name)]
    return f"zero_optimization.{used[0]}" if used else None


def _mics_key(config: Config) -> str | None:
    # mics_shard_size is built (hybrid sharding, hybrid/hierarchy.py); MiCS's hierarchical gather is not
    zero = config.zero_optimization
    return ("zero_optimization.mics_hierarchical_params_gather"
            if zero.mics_hierarchical_params_gather else None)


# Feature name -> the config key that turns it on in `config`, or None when unused.
_FEATURE_KEYS: dict[str, Callable[[Config], str | None]] = {
    "stage3": lambda c: "zero_optimization.stage" if c.zero_optimization.stage == 3 else None,
    "offload_optimizer": lambda c: "zero_optimization.offload_optimizer.device"
    if c.zero_optimization.offload_optimizer_device != "none" else None,
    "offload_param": lambda c: "zero_optimization.offload_param.device"
    if c.zero_optimization.offload_param_device != "none" else None,
    "activation_checkpointing": _activation_checkpointing_key,
    "zeropp": _zeropp_key,
    "mics": _mics_key,
    "elastic_checkpoint": lambda c: "zero_optimization.elastic_checkpoint"
    if c.zero_optimization.elastic_checkpoint else None,
}


def check_supported(config: Config) -> None:
    """Raise Unsupported if `config` uses a feature in NOT_BUILT or OUT_OF_SCOPE."""
    for feature, key in config.unsupported_features().items():
        value = config.value_at(key)
        if feature in NOT_BUILT:
            raise Unsupported(key, feature, "not built yet", value,
                              f"{key} = {value!r} is not supported yet (zeromem feature "
                              f"{feature!r} is not built)")
        raise Unsupported(key, feature, "zeromem does not implement it", value,
                          f"{key} = {value!r} is not supported (zeromem does not implement "
                          f"{feature!r})")


# ---------------------------------------------------------------- top level

class Config(Extras):
    """A DeepSpeed JSON config, validated. Build it with `Config.load`.

    The monitors, comms_logger, flops_profiler and other DeepSpeed extras zeromem runs are
    fields of `config.extras.Extras`; DeepSpeed features without a field are accepted while
    off and refused when on by `config.features` (kept, when off, in `inert`).
    """

    _renamed = TOP_LEVEL_RENAMED
    _also_known: ClassVar[tuple[str, ...]] = features.TOP_LEVEL  # taken before validation
    _raw: dict | None = PrivateAttr(default=None)  # the input as given, for re-resolving
    _inert: dict[str, Any] = PrivateAttr(default_factory=dict)  # DeepSpeed blocks left off
    _hidden_size: int | None = PrivateAttr(default=None)  # what resolved hidden-size "auto"s

    train_batch_size: Int | None = Field(None, ge=1)  # global batch = micro × gas × world_size
    train_micro_batch_size_per_gpu: Int | None = Field(None, ge=1)  # per-rank forward batch
    gradient_accumulation_steps: Int | None = Field(None, ge=1)  # micro-steps per optimizer step
    gradient_clipping: Float = Field(1.0, ge=0)  # global-norm clip; 0.0 = off (DeepSpeed 0.19.8)
    steps_per_print: StepsPerPrint = 10  # logging interval in optimizer steps; Infinity = never
    wall_clock_breakdown: Bool = False  # per-phase timers
    prescale_gradients: Bool = False  # scale grads before the reduction instead of after
    gradient_predivide_factor: Float = Field(1.0, gt=0)  # divide grads by this before averaging
    communication_data_type: Dtype | None = None  # gradient reduction dtype; None = grad dtype
    zero_allow_untested_optimizer: Bool = False  # allow a client optimizer with ZeRO
    zero_force_ds_cpu_optimizer: Bool = True  # require the CPU optimizer when offloading
    optimizer: OptimizerConfig | None = None  # None = the client passes its own optimizer
    scheduler: SchedulerConfig | None = None  # None = no schedule (or the client's)
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    zeromem: TimeoutsConfig = Field(default_factory=TimeoutsConfig)  # waits for other ranks

    @model_validator(mode="wrap")
    @classmethod
    def _resolve_auto_values(cls, data: Any, handler: Callable, info: Any) -> Config:
        if not isinstance(data, dict):
            return handler(data)
        raw = copy.deepcopy(data)
        hidden_size = (info.context or {}).get("hidden_size")
        data, derived = resolve_auto(data, hidden_size)
        config = handler(data)
        config._raw, config._hidden_size = raw, hidden_size
        for path in derived:
            *parents, leaf = path.split(".")
            config.value_at(".".join(parents))._derived.add(leaf)
        return config

    @model_validator(mode="after")
    def _check_cross_block_rules(self, info: Any) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled and bf16.enabled cannot both be true")
        asked = self.data_types.param_dtype
        if asked is not None and DTYPES[asked] != self.compute_dtype:
            raise ConfigError(f"data_types.param_dtype {asked!r} is not the precision blocks' "
                              f"{self.compute_dtype}: set the matching fp16 / bf16 \"enabled\", "
                              "or leave param_dtype out")
        check_bf16_masters(self.bf16, self.zero_optimization.stage,
                           self.zero_optimization.offload_optimizer_device)
        whole = {"Lamb": "Lamb's trust ratio needs each parameter's whole update",
                 "Muon": "Muon orthogonalises each weight matrix's update whole"}
        if self.optimizer and self.optimizer.type in whole and \
                self.zero_optimization.offload_optimizer_device == "nvme":
            raise Unsupported("zero_optimization.offload_optimizer.device",
                              f"{self.optimizer.type} with NVMe optimizer offload",
                              f"{whole[self.optimizer.type]} before any of it is applied, and "
                              "NVMe offload steps the optimizer tile by tile; offload to \"cpu\" "
                              "instead", "nvme")
        world_size = (info.context or {}).get("world_size")
        if world_size is not None:
            given = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                     self.gradient_accumulation_steps)
            for key, value in zip(BATCH_KEYS, resolve_batch(*given, world_size)):
                if getattr(self, key) is None:
                    setattr(self, key, value)
                    self._derived.add(key)
        return self

    def batch(self) -> tuple[int, int, int]:
        """(train_batch_size, micro batch per rank, accumulation steps), as `load` resolved them."""
        train, micro, gas = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                             self.gradient_accumulation_steps)
        if train is None or micro is None or gas is None:
            raise ConfigError("the batch sizes are resolved only by Config.load(..., world_size=N)")
        return train, micro, gas

    @classmethod
    def read(cls, source: dict | str | os.PathLike | Config) -> tuple[dict, str | None]:
        """`source` as the JSON object it holds, unvalidated, and the file it came from."""
        if isinstance(source, Config):
            raw = source._raw if source._raw is not None else source.model_dump(exclude_unset=True)
            return raw, None
        if isinstance(source, str) and source.lstrip().startswith("{"):
            return _parse_json(source, "JSON text"), None  # a config given inline, not a path
        if isinstance(source, (str, os.PathLike)):
            return _read_json(os.fspath(source)), os.fspath(source)
        if isinstance(source, dict):
            return source, None
        raise ConfigError("config source must be a dict, a JSON file path or a Config, got "
                          f"{type(source).__name__}")

    @classmethod
    def load(cls, source: dict | str | os.PathLike | Config, world_size: int | None = None,
             hidden_size: int | None = None) -> Config:
        """Validate `source` (a dict, a JSON file path or a Config) into a Config.

        `world_size` (data-parallel ranks) resolves the batch triple; None skips it.
        `hidden_size` resolves hidden-size "auto" values. A Config is re-resolved from
        the input it was built from (keeping its hidden_size unless a new one is given).
        Raises ConfigError naming the offending key.
        """
        data, origin = cls.read(source)
        if isinstance(source, Config):
            hidden_size = hidden_size if hidden_size is not None else source._hidden_size
        for name, value in (("world_size", world_size), ("hidden_size", hidden_size)):
            bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
            if value is not None and bad:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        inert = source.inert if isinstance(source, Config) else {}
        try:
            data, taken = features.take_features(data, [*cls.model_fields, *cls._renamed])
            config = cls.model_validate(
                data, context={"world_size": world_size, "hidden_size": hidden_size})
            config._inert = {**inert, **taken}
            check_supported(config)
        except ValidationError as error:
            message = humanise(error, cls)
            refused = [e["ctx"]["error"] for e in error.errors()
                       if isinstance((e.get("ctx") or {}).get("error"), Unsupported)]
            if refused:  # keep the kind (and key, feature, reason) of a refusal
                raise _located(refused[0], origin, message) from None
            raise ConfigError(f"{origin}: {message}" if origin else message) from None
        except ConfigError as error:
            raise _located(error, origin, str(error)) from None
        return config

    def unsupported_features(self) -> dict[str, str]:
        """Features of NOT_BUILT or OUT_OF_SCOPE this config uses, mapped to the key using each."""
        used = {}
        for feature in sorted(NOT_BUILT | OUT_OF_SCOPE):
            key = _FEATURE_KEYS[feature](self) if feature in _FEATURE_KEYS else None
            if key:
                used[feature] = key
        return used

    @property
    def inert(self) -> dict[str, Any]:
        """DeepSpeed feature blocks the config gave and left off, by dotted key (accepted)."""
        return self._inert

    def value_at(self, dotted: str) -> Any:
        """The value at a dotted key path such as "zero_optimization.stage"; "" is self."""
        value: Any = self
        for name in filter(None, dotted.split(".")):
            value = getattr(value, name)
        return value

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of forward/backward: fp16, bf16 or fp32."""
        if self.fp16.enabled:
            return torch.float16
        return torch.bfloat16 if self.bf16.enabled else torch.float32

    @property
    def master_dtype(self) -> torch.dtype:
        """Dtype of the masters the optimizer steps, their gradients and its states: fp32,
        or bf16 under bf16.bf16_master_weights_and_grads (the parameter shard itself)."""
        return torch.bfloat16 if self.bf16.bf16_master_weights_and_grads else torch.float32

    @property
    def casts_module(self) -> bool:
        """A precision block casts the module's frozen parameters to its 16 bits too, and
        some of its buffers (module_dtypes.py); in fp32 only the trained parameters are
        cast (to their masters' dtype), the rest keep the user's dtype."""
        return self.compute_dtype != torch.float32

    @property
    def buffer_dtype(self) -> torch.dtype | None:
        """data_types.buffer_dtype as a torch dtype (None: buffers keep theirs)."""
        name = self.data_types.buffer_dtype
        return DTYPES[name] if name else None

    @property
    def grad_dtype(self) -> torch.dtype:
        """Dtype of accumulated gradients: data_types.grad_accum_dtype, else compute_dtype."""
        accum = self.data_types.grad_accum_dtype
        return DTYPES[accum] if accum else self.compute_dtype

    def describe(self) -> str:
        """Every resolved value, one per line, with where it came from (default/file/derived)."""
        lines: list[str] = []
        _describe_block(self, "", lines)
        lines += [f"{key:<56} {value!r:<24} accepted off" for key, value in self.inert.items()]
        return "\n".join(lines)


def _located(error: ConfigError, origin: str | None, message: str) -> ConfigError:
    """`error` (its kind and fields kept) saying `message`, prefixed by the file it came from."""
    error.args = (f"{origin}: {message}" if origin else message,)
    return error


def _describe_block(block: BaseModel, prefix: str, lines: list[str]) -> None:
    for name in type(block).model_fields:
        value, path = getattr(block, name), prefix + name
        if isinstance(value, BaseModel):  # a nested block (cluster.py's is not a _Block)
            _describe_block(value, f"{path}.", lines)
            continue
        source = ("derived" if name in getattr(block, "_derived", ())
                  else "file" if name in block.model_fields_set else "default")
        lines.append(f"{path:<56} {value!r:<24} {source}")


class _DuplicateKeys(dict):
    """A JSON object that named some keys more than once (kept: the last value of each)."""

    duplicates: list[str]


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    # json keeps the last of duplicate keys silently; DeepSpeed refuses them. The hook sees
    # one object at a time, innermost first, so it marks the object and _check_duplicates
    # finds its dotted path afterwards.
    data = dict(pairs)
    if len(data) == len(pairs):
        return data
    keys = [key for key, _ in pairs]
    marked = _DuplicateKeys(data)
    marked.duplicates = [key for i, key in enumerate(keys) if key in keys[:i]]
    return marked


def _check_duplicates(value: Any, path: str) -> None:
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_duplicates(item, f"{path}{i}.")
    if not isinstance(value, dict):
        return
    if isinstance(value, _DuplicateKeys):
        key = value.duplicates[0]
        raise ConfigError(f"{path}{key} is given more than once; give each key once (JSON "
                          "parsers keep the last silently, DeepSpeed refuses the file)")
    for key, item in value.items():
        _check_duplicates(item, f"{path}{key}.")


def _parse_json(text: str, origin: str) -> dict:
    """The JSON object in `text`, refusing duplicate keys; `origin` names it in errors."""
    try:
        data = json.loads(text, object_pairs_hook=_refuse_duplicates)
    except (ValueError, RecursionError) as error:  # also a number past Python's digit limit
        raise ConfigError(f"{origin}: not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: the top level must be a JSON object, "
                          f"got {type(data).__name__}")
    try:
        _check_duplicates(data, "")
    except ConfigError as error:
        raise ConfigError(f"{origin}: {error}") from None
    return dict(data)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text: {error}") from None
    return _parse_json(text, path)
