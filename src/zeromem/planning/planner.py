"""Plan a ZeRO configuration for a real model on given hardware (`zeromem plan`).

The model is built on the meta device (nothing is allocated) from a factory
(`package.module:function`) or from a Hugging Face-style config JSON, which is
turned into an equivalent GPT shape list (`planning/model_shapes.py`; `load_model` and
`shape_of` are re-exported here). From the real parameter shapes the
planner computes each rank's memory exactly as the engine lays it out
(`shape_memory.exact_model_states`: reduce buckets, padding to N_d, fetch units and
persistence at stage 3), adds activations (`shape_memory.activation_memory`) and
buffers, predicts a step time, and recommends a setup following the seed's
section 6:

    1. the lowest stage that fits: stage 1 rather than plain data parallelism
       when N_d > 1 (same 2Ψ traffic, paper section 7), then stage 2;
    2. activation checkpointing before ZeRO-3 (a third more compute, but no
       extra traffic);
    3. ZeRO-3 only when stages 1-2 cannot fit (1.5x the traffic);
    4. offload (CPU, then NVMe) only when nothing fits on the GPUs.

Step time = compute (6Ψ + 12·L·h·s FLOPs per token, a third more with
checkpointing, at an assumed achieved TFLOPS) against data-parallel traffic
(2Ψ elements per step at stages 0-1, Ψ per micro-step plus Ψ at stage 2, 3Ψ per
micro-step at stage 3, ring-scaled by (N_d - 1)/N_d, over --interconnect) and
offload traffic over --pcie and --nvme. Printed as a range: perfect overlap
(the largest of the three) to none (their sum). With assumed speeds the
optimizer step and the engine's own overhead are not modelled; `--calibrate`
measures both on this machine (`planning/calibrate.py`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeromem.config.schema import Config
from zeromem.layout import derived_bucket_numel, derived_prefetch_numel
from zeromem.planning.estimate import estimate, format_bytes, format_count
from zeromem.planning.shape_memory import (ActivationMemory, ModelShape, ShapeMemory, Widths,
                                           ZeroLayout, activation_memory, exact_model_states,
                                           paper_activation_bytes, rank_shards)
from zeromem.planning.activation_trace import ActivationProfile, trace_activations
from zeromem.planning.host_memory import OffloadBufferSizes, least_budget
from zeromem.planning.model_shapes import ConfigGPT, load_model, shape_of
from zeromem.stage3.units import UnitCaps

if TYPE_CHECKING:
    from zeromem.planning.step_model import Calibration

__all__ = ["estimate", "plan", "load_model", "shape_of", "predict_memory", "Plan", "Hardware",
           "Workload", "Setup"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPE_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------- the engine's layout from a config

def widths_for(config: Config, shape: ModelShape | None = None) -> Widths:
    """Byte widths of each model state for a validated zeromem config (for Muon, averaged
    over `shape`'s parameters)."""
    compute = config.compute_dtype
    opt = config.optimizer
    kind = opt.type.lower() if opt else "adamw"
    options = opt.params if opt else {}
    states: float
    if kind == "sgd":
        states, scalars = (4 if options.get("momentum") else 0), 0
    elif kind == "muon" and shape is not None and shape.psi:  # momentum; Adam's m and v
        states, scalars = (4 * shape.muon_numel + 8 * (shape.psi - shape.muon_numel)) / shape.psi, 4
    else:  # Adam / AdamW: m and v (and max v with amsgrad), plus a scalar `step`
        states, scalars = (12 if options.get("amsgrad") else 8), 4
    master = config.master_dtype  # bf16 masters: the states are bf16 too (half the bytes)
    return Widths(compute.itemsize, config.grad_dtype.itemsize,
                  0 if compute == master else master.itemsize, states * master.itemsize / 4,
                  scalars)


def layout_for(config: Config, shape: ModelShape | None = None, n_d: int = 1,
               backend: str = "nccl", device: str = "cuda") -> ZeroLayout:
    """The grouping and partitioning knobs of a validated zeromem config; with `shape`, the
    bucket sizes the config leaves out are derived as the engine derives them (layout.py).
    `backend`: the collectives' (gloo stages reduce-scatters in a receive buffer); `device`:
    where the ranks compute ("cpu": host memory is the device's)."""
    z = config.zero_optimization
    buckets = {k: int(getattr(z, k)) for k in ("reduce_bucket_size", "allgather_bucket_size",
                                                "stage3_prefetch_bucket_size")}
    if shape is not None:
        derived = derived_bucket_numel(shape.psi, n_d)
        buckets.update({k: derived for k in ("reduce_bucket_size", "allgather_bucket_size")
                        if k not in z.model_fields_set})
        if "stage3_prefetch_bucket_size" not in z.model_fields_set:
            buckets["stage3_prefetch_bucket_size"] = derived_prefetch_numel(shape.largest_unit)
    buffers = OffloadBufferSizes.from_config(config)  # as the engine reads them
    return ZeroLayout(z.stage, buckets["reduce_bucket_size"], buckets["allgather_bucket_size"],
                      int(z.stage3_param_persistence_threshold),
                      buckets["stage3_prefetch_bucket_size"],
                      z.offload_optimizer_device, z.offload_param_device, buffers,
                      bool(z.overlap_comm), backend, device)


def predict_memory(model: nn.Module | ModelShape, config: dict | str | Config,
                   n_d: int, backend: str = "nccl", device: str = "cuda") -> ShapeMemory:
    """Per-rank bytes the engine will hold for `model` under `config` on N_d ranks of
    `backend` (which sizes the communication buffers) computing on `device`: "cuda" (GPUs),
    or "cpu" (this machine, where the engine keeps an fp32 gradient once, not on the
    device and again on the host)."""
    cfg = Config.load(config, world_size=n_d)
    shape = model if isinstance(model, ModelShape) else \
        shape_of(model, leaves=cfg.zero_optimization.leaf_module.modules(model))
    widths = widths_for(cfg, shape)
    # fetch units merged as the engine merges them under this config; then the prefetch
    # depth the engine derives from the largest of them
    shape = shape.with_unit_caps(layout_for(cfg, shape, n_d).unit_caps(widths.param, n_d))
    return exact_model_states(shape, n_d, widths, layout_for(cfg, shape, n_d, backend, device))


# ---------------------------------------------------------------- hardware, workload, setups

@dataclass(frozen=True)
class Hardware:
    """The machines: bandwidths in bytes/s, per GPU except NVMe (per node)."""

    gpus: int
    gpu_mem_bytes: float
    nodes: int = 1
    interconnect: float = 25e9  # data-parallel collectives, per GPU
    pcie: float = 16e9  # host <-> device, per GPU
    nvme: float = 3.5e9  # per node, shared by its GPUs
    tflops: float = 100.0  # achieved per GPU (not peak)
    host_mem_bytes: float | None = None  # per node; None = not checked
    headroom: float = 0.9  # usable share of GPU memory (allocator, CUDA context, fragmentation)
    # measured figures (`planning/calibrate.py`) that replace the assumed speeds above
    calibration: Calibration | None = None

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.gpus // self.nodes)

    @property
    def backend(self) -> str:
        """The collectives' backend: the calibrated one, else NCCL (GPUs)."""
        return self.calibration.backend if self.calibration is not None else "nccl"

    @property
    def device(self) -> str:
        """Where the ranks compute, which the memory plan is for: the calibrated ranks'
        device (`calibrate` runs on this machine's CPU), else "cuda" (GPUs)."""
        return self.calibration.device if self.calibration is not None else "cuda"


@dataclass(frozen=True)
class Workload:
    """One rank's micro-batch and the training precision."""

    micro_batch: int = 1
    seq: int = 0  # 0: the model's context length, else 1024
    gas: int = 1  # gradient accumulation steps
    dtype: str = "bf16"
    mp: int = 1  # model-parallel degree (N_d = gpus / mp)
    flash: bool = False  # fused attention: no s x s score matrices are stored (formula only)
    activations: ActivationProfile | None = None  # traced at this micro-batch, seq and dtype;
    # None: the Korthikanti et al. formula (`shape_memory.activation_memory`)


def activations_of(shape: ModelShape, work: Workload, checkpointing: str = "none",
                   partition: bool | None = None) -> ActivationMemory:
    """One rank's activation bytes: from the traced profile when there is one, else the formula."""
    split = work.mp > 1 if partition is None else partition
    if work.activations is not None:
        return work.activations.memory(checkpointing, work.mp, split)
    return activation_memory(shape, work.micro_batch, work.seq, DTYPE_BYTES[work.dtype],
                             checkpointing != "none", work.mp, split, checkpointing == "cpu",
                             work.flash)


def traced_workload(model: nn.Module, shape: ModelShape, work: Workload) -> tuple[Workload, str]:
    """`work` with the activations of one traced forward of `model`, and a note on the source."""
    try:
        profile = trace_activations(model, work.micro_batch, work.seq, DTYPE_TORCH[work.dtype],
                                    shape.vocab)
    except Exception as error:  # any forward the trace cannot run: say so, use the formula
        return work, (f"activations from the formula (Korthikanti et al.): tracing the forward "
                      f"failed ({type(error).__name__}: {str(error)[:120]})")
    return (dataclasses.replace(work, activations=profile),
            f"activations traced from one forward of the model; blocks: {profile.blocks or 'none'}")


@dataclass(frozen=True)
class Setup:
    """One configuration the planner considers."""

    stage: int
    checkpointing: str = "none"  # "none" | "gpu" | "cpu" (Pa+cpu: checkpoints in host memory)
    offload_optimizer: str = "none"
    offload_param: str = "none"

    def label(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.checkpointing != "none":
            parts.append("ckpt" + (":cpu" if self.checkpointing == "cpu" else ""))
        if self.offload_optimizer != "none":
            parts.append(f"opt:{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param:{self.offload_param}")
        return ", ".join(parts)


def preference_order(n_d: int) -> list[Setup]:
    """Setups in the order the seed's section 6 prefers them (the first that fits wins)."""
    low = [0] if n_d == 1 else [1, 2]  # with one rank, sharding saves nothing
    order = [Setup(s) for s in low] + [Setup(s, "gpu") for s in low]
    if n_d > 1:
        order += [Setup(3), Setup(3, "gpu"), Setup(3, "cpu")]
    return order + [Setup(2, "gpu", "cpu"), Setup(3, "gpu", "cpu"), Setup(3, "gpu", "cpu", "cpu"),
                    Setup(3, "cpu", "cpu", "cpu"), Setup(3, "cpu", "nvme", "cpu"),
                    Setup(3, "cpu", "nvme", "nvme")]


def planned_layout(shape: ModelShape, setup: Setup) -> ZeroLayout:
    """Bucket sizes the planner writes into the config.

    Reduce / all-gather buckets: about 16 per model so reduction overlaps backward,
    no smaller than hidden² (Hugging Face's "auto") and no larger than 2e8 elements
    (the seed's constant-buffer example). Stage 3: prefetch 0.9·hidden² and
    persistence threshold 10·hidden, Hugging Face's "auto" values.
    """
    h = shape.hidden
    bucket = int(min(2e8, max(h * h, -(-shape.psi // 16))))
    return ZeroLayout(setup.stage, bucket, bucket, 10 * h, int(0.9 * h * h),
                      setup.offload_optimizer, setup.offload_param,
                      overlap_comm=True)  # as `deepspeed_config` writes it


# ---------------------------------------------------------------- evaluating one setup

@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by kind of work."""

    compute: float
    comm: float
    offload: float
    optimizer: float = 0.0  # the step itself, after backward: overlaps nothing
    can_overlap: bool = True  # False: one CPU runs everything in turn (a gloo calibration)
    overhead: float = 0.0  # the engine's own work (hooks, bookkeeping): calibrated only

    @property
    def overlapped(self) -> float:
        if not self.can_overlap:
            return self.serial
        return max(self.compute, self.comm, self.offload) + self.optimizer + self.overhead

    @property
    def serial(self) -> float:
        return self.compute + self.comm + self.offload + self.optimizer + self.overhead


def model_flops(shape: ModelShape, work: Workload) -> float:
    """Forward + backward FLOPs of one micro-batch on one rank: (6Ψ + 12·L·h·s) per token,
    Ψ the parameters a token computes with (a mixture of experts': its top-k experts only)."""
    tokens = work.micro_batch * work.seq
    return (6 * shape.active_numel + 12 * shape.layers * shape.hidden * work.seq) * tokens / work.mp


@dataclass(frozen=True)
class Candidate:
    """A setup with its per-rank memory and predicted step time."""

    setup: Setup
    layout: ZeroLayout
    states: ShapeMemory
    activations: ActivationMemory
    time: StepTime
    device_bytes: float
    host_bytes: float  # per rank
    nvme_bytes: float  # per rank
    fits: bool


def step_time(shape: ModelShape, setup: Setup, states: ShapeMemory, acts: ActivationMemory,
              hw: Hardware, work: Workload) -> StepTime:
    """Compute, data-parallel traffic and offload traffic of one step (see module docstring)."""
    n_d, gas = hw.gpus // work.mp, work.gas
    flops = model_flops(shape, work) * gas
    if setup.checkpointing != "none":
        flops *= 4 / 3  # one more forward pass
    elements = {0: 2, 1: 2, 2: gas + 1, 3: 3 * gas}[setup.stage] * shape.psi / work.mp
    p = DTYPE_BYTES[work.dtype]
    comm = elements * p * (n_d - 1) / n_d / hw.interconnect
    shard = shape.psi / work.mp / n_d
    pcie = 2 * acts.host * gas  # Pa+cpu: checkpoints go down in forward, up in backward
    nvme = 0.0
    if setup.offload_optimizer != "none":
        pcie += 2 * p * shard  # gradient shard down, updated parameter shard up
        if setup.offload_optimizer == "nvme":
            nvme += 2 * (states.nvme_bytes - (p * shard if setup.offload_param == "nvme" else 0))
    if setup.offload_param != "none":
        pcie += 2 * p * shard * gas  # fetched for forward and again for backward
        if setup.offload_param == "nvme":
            nvme += p * shard * (2 * gas + 1)
    offload = pcie / hw.pcie + nvme * hw.gpus_per_node / hw.nvme
    return StepTime(flops / (hw.tflops * 1e12), comm, offload)


def evaluate(shape: ModelShape, setup: Setup, hw: Hardware, work: Workload) -> Candidate:
    """Per-rank memory and step time of `setup`; fits = device and host memory suffice."""
    n_d = hw.gpus // work.mp
    layout = dataclasses.replace(planned_layout(shape, setup), backend=hw.backend,
                                 device=hw.device)
    p = DTYPE_BYTES[work.dtype]
    widths = Widths(p, p, 0 if p == 4 else 4, 8, 4)  # AdamW, as the written config says
    # fetch units merged as the engine will under the written config: within its reduce
    # bucket, then (the budget known) within the NVMe parameter pool's share of it
    shape = shape.with_unit_caps(UnitCaps(layout.reduce_bucket_numel, None,
                                          layout.persistence_threshold))
    if setup.offload_optimizer == "nvme":  # the host budget the written config names
        budget = least_budget(rank_shards(shape, n_d, layout), setup.offload_param, p,
                              widths.states, setup.stage >= 2, layout.offload)
        layout = dataclasses.replace(layout, offload=dataclasses.replace(
            layout.offload, host_budget_bytes=budget))
        shape = shape.with_unit_caps(layout.unit_caps(p, n_d))
    # Model parallelism splits (nearly) every parameter over MP ranks before ZeRO partitions.
    states = exact_model_states(shape, n_d, widths, layout).scaled(1 / work.mp)
    acts = activations_of(shape, work, setup.checkpointing)
    device = states.model_state_bytes + states.gathered_params + states.comm_buffers + acts.device
    host = states.host_bytes + acts.host
    fits = device <= hw.gpu_mem_bytes * hw.headroom and (
        hw.host_mem_bytes is None or host * hw.gpus_per_node <= hw.host_mem_bytes)
    time = (hw.calibration.step_time(shape, setup, layout, states, acts, work, n_d)
            if hw.calibration is not None else step_time(shape, setup, states, acts, hw, work))
    return Candidate(setup, layout, states, acts, time, device, host, states.nvme_bytes, fits)


# ---------------------------------------------------------------- recommendation

@dataclass(frozen=True)
class Plan:
    """Every setup considered, the one recommended, why, and its DeepSpeed-style config."""

    shape: ModelShape
    hardware: Hardware
    workload: Workload
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    reasons: tuple[str, ...]
    config: dict
    units: str = "GB"

    def __str__(self) -> str:
        return "\n".join(_describe(self))


def plan(model: str | nn.Module | ModelShape, hardware: Hardware, workload: Workload = Workload(),
         units: str = "GB", nvme_path: str | None = None,
         traced: nn.Module | None = None) -> Plan:
    """Evaluate the setups of `preference_order` for `model` and recommend the first that fits.

    `model`: a factory path or config JSON (see `load_model`), a module (meta is fine) or a
    `ModelShape`. Activations are traced from one forward of the real model (`traced`, else
    `model` when it is a module or a factory, else the Hugging Face model a config JSON
    describes) unless `workload.activations` is given; a `ModelShape` alone gets the
    formula. `nvme_path`: the directory an NVMe setup's config names (required to
    recommend one).
    """
    if isinstance(model, str):
        module, cfg = load_model(model)
        shape = shape_of(module, cfg, name=Path(model).stem)
        traced = traced or (None if isinstance(module, ConfigGPT) else module)
    else:
        shape = model if isinstance(model, ModelShape) else shape_of(model)
        traced = traced or (model if isinstance(model, nn.Module) else None)
    if hardware.gpus % workload.mp:
        raise ValueError(f"--gpus {hardware.gpus} is not a multiple of the model-parallel degree "
                         f"{workload.mp}")
    if not workload.seq:
        workload = dataclasses.replace(workload, seq=shape.positions or 1024)
    source = "activations from the formula (Korthikanti et al.): no forward to trace"
    if workload.activations is not None:
        source = "activations traced from one forward of the model"
    elif traced is not None:
        workload, source = traced_workload(traced, shape, workload)
    n_d = hardware.gpus // workload.mp
    order = preference_order(n_d)
    setups = ([Setup(0)] if order[0] != Setup(0) else []) + order
    candidates = tuple(evaluate(shape, s, hardware, workload) for s in setups)
    ranked = [c for c in candidates if c.setup in order]
    chosen = next((c for c in ranked if c.fits), ranked[-1])
    config = deepspeed_config(chosen, shape, workload, n_d, nvme_path)
    reasons = _reasons(chosen, candidates, ranked, shape, hardware, workload, units)
    reasons += [source] + _setup_calls(chosen, workload, nvme_path)
    return Plan(shape, hardware, workload, candidates, chosen,
                tuple(reasons + _config_notes(config, n_d)), config, units)


def checkpointing_call(setup: Setup) -> str:
    """The call a model needs before `initialize` for `setup`'s activation checkpointing."""
    if setup.checkpointing == "none":
        return ""
    return "zeromem.checkpointing.enable(model)"


def _setup_calls(chosen: Candidate, work: Workload, nvme_path: str | None) -> list[str]:
    """What the user must do besides passing the config: checkpointing call, NVMe path."""
    out = []
    if chosen.setup.checkpointing != "none":
        blocks = work.activations.blocks if work.activations is not None else ""
        out.append("the activation_checkpointing block acts only on calls to zeromem.checkpoint: "
                   f"call {checkpointing_call(chosen.setup)} before zeromem.initialize"
                   + (f" (checkpoints {blocks})" if blocks else "")
                   + ", unless the model calls zeromem.checkpoint itself")
    if "nvme" in (chosen.setup.offload_optimizer, chosen.setup.offload_param) and not nvme_path:
        out.append("this setup swaps to NVMe: give --nvme-path DIR (a directory on a local NVMe "
                   "disk) and the config will name it")
    return out


def _reasons(chosen: Candidate, candidates: tuple[Candidate, ...], ranked: list[Candidate],
             shape: ModelShape, hw: Hardware, work: Workload, u: str) -> list[str]:
    """Why `chosen`: what did not fit before it, what it costs, and what would help."""
    usable = hw.gpu_mem_bytes * hw.headroom
    gb = lambda b: f"{format_bytes(b, u)} {u}"  # noqa: E731
    s = chosen.setup
    skipped = ranked[:ranked.index(chosen)]
    out = [f"{c.setup.label()} does not fit: {gb(c.device_bytes)} per GPU > {gb(usable)} usable"
           + ("" if c.device_bytes > usable else " (host memory)")
           for c in (skipped if len(skipped) <= 4 else skipped[:2] + skipped[-1:])]
    if len(skipped) > 4:
        out.insert(2, f"... and {len(skipped) - 3} more setups in between do not fit")
    if not chosen.fits:
        out.append(f"nothing fits; the last resort {s.label()} needs {gb(chosen.device_bytes)} "
                   f"per GPU. {_gpus_needed(shape, hw, work)}")
    else:
        out.append(f"{s.label()} fits: {gb(chosen.device_bytes)} of {gb(usable)} usable per GPU")
    plain = candidates[0]
    if s.stage == 1 and plain.setup == Setup(0) and plain.fits:
        out.append(f"plain data parallelism also fits ({gb(plain.device_bytes)}); stage 1 moves the "
                   "same 2Ψ per step (paper section 7) and frees "
                   f"{gb(plain.device_bytes - chosen.device_bytes)} per GPU for batch or sequence")
    if s.stage == 2 and work.gas > 1:
        out.append(f"stage 2 reduce-scatters every micro-step: ({work.gas}+1)Ψ per step, not 2Ψ")
    if s.stage == 3:
        out.append("ZeRO-3 only because stages 1-2 do not fit even with checkpointing: it moves "
                   "3Ψ per micro-step, 1.5x plain data parallelism")
    if s.checkpointing != "none":
        full = activations_of(shape, work).device
        out.append(f"activation checkpointing: activations {gb(full)} -> "
                   f"{gb(chosen.activations.device)} per GPU for a third more compute"
                   + (f"; checkpoints in host memory (Pa+cpu): {gb(chosen.activations.host)} per rank"
                      if s.checkpointing == "cpu" else ""))
        if work.mp == 1:
            out.append("Pa (partition_activations) stays off: without model parallelism no "
                       "rank holds a copy of another's checkpoints, so there is nothing to split")
    if s.offload_optimizer != "none" or s.offload_param != "none":
        node = hw.gpus_per_node
        out.append(f"offload because nothing fits on the GPUs: {gb(chosen.host_bytes * node)} host "
                   f"and {gb(chosen.nvme_bytes * node)} NVMe per node of {node} GPUs; "
                   f"{chosen.time.offload:.3g} s of transfers per step")
    t = chosen.time
    out.append(f"step {t.overlapped:.3g}-{t.serial:.3g} s (full overlap to none): compute "
               f"{t.compute:.3g} s at "
               + (f"{hw.calibration.flops / 1e12:.3g} TFLOPS (measured)" if hw.calibration
                  else f"{hw.tflops:g} TFLOPS (assumed)")
               + f", data-parallel traffic {t.comm:.3g} s"
               + (f", optimizer step {t.optimizer:.3g} s" if t.optimizer else ""))
    if t.comm > t.compute:
        out.append("communication-bound: a faster interconnect, a larger micro-batch or more "
                   "accumulation steps would raise throughput")
    return out


def _gpus_needed(shape: ModelShape, hw: Hardware, work: Workload) -> str:
    """How many GPUs stage 3 with checkpointing would need, without offload."""
    gpus = hw.gpus
    while gpus < 2 ** 20:
        gpus *= 2
        trial = dataclasses.replace(hw, gpus=gpus, nodes=max(1, gpus // hw.gpus_per_node))
        if evaluate(shape, Setup(3, "gpu"), trial, work).fits:
            return f"Stage 3 with checkpointing would fit on {gpus} such GPUs without offload."
    return "Even a million GPUs would not fit one micro-batch: shorten the sequence."


def deepspeed_config(chosen: Candidate, shape: ModelShape, work: Workload, n_d: int,
                     nvme_path: str | None = None) -> dict:
    """A ready DeepSpeed-style JSON config for `chosen` (zeromem reads the same keys)."""
    s, layout = chosen.setup, chosen.layout
    zero: dict[str, Any] = {"stage": s.stage, "contiguous_gradients": True, "overlap_comm": True,
                            "reduce_bucket_size": layout.reduce_bucket_numel,
                            "allgather_bucket_size": layout.allgather_bucket_numel}
    if s.stage == 3:
        zero.update(stage3_prefetch_bucket_size=layout.prefetch_numel,
                    stage3_param_persistence_threshold=layout.persistence_threshold)
    for key, device in (("offload_optimizer", s.offload_optimizer), ("offload_param", s.offload_param)):
        if device != "none":
            zero[key] = {"device": device, "pin_memory": True,
                         **({"nvme_path": nvme_path or ""} if device == "nvme" else {})}
    config: dict[str, Any] = {
        "train_batch_size": work.micro_batch * work.gas * n_d,
        "train_micro_batch_size_per_gpu": work.micro_batch,
        "gradient_accumulation_steps": work.gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1}},
        "zero_optimization": zero,
    }
    if work.dtype != "fp32":
        config[work.dtype] = {"enabled": True}
    if s.offload_optimizer == "nvme":  # sizes the swap pools as planned (offload/budget.py)
        config["zeromem"] = {"offload_host_budget_bytes": layout.offload.host_budget_bytes}
    if s.checkpointing != "none":
        config["activation_checkpointing"] = {
            "partition_activations": work.mp > 1, "cpu_checkpointing": s.checkpointing == "cpu",
            "contiguous_memory_optimization": True,
            # MD's pool holds one stored input per checkpointed block
            "number_checkpoints": len(work.activations.block_bytes) if work.activations is not None
            and work.activations.block_bytes else shape.layers}
    return config


def _config_notes(config: dict, n_d: int) -> list[str]:
    """Validate `config` against zeromem's schema; name the features zeromem cannot run yet."""
    try:
        parsed = Config.model_validate(config, context={"world_size": n_d})
    except Exception as error:  # a planner bug: say so rather than hand out a bad config
        return [f"warning: the generated config does not validate: {error}"]
    missing = parsed.unsupported_features()
    if not missing:
        return []
    return ["zeromem cannot run yet: " + ", ".join(f"{f} ({k})" for f, k in missing.items())
            + "; DeepSpeed reads the same config"]


def _describe(p: Plan) -> list[str]:
    s, hw, w, u = p.shape, p.hardware, p.workload, p.units
    n_d = hw.gpus // w.mp
    node = hw.gpus_per_node
    acts = [activations_of(s, w, ckpt).device for ckpt in ("none", "gpu")]
    paper = paper_activation_bytes(s.hidden, w.micro_batch, w.seq, s.layers)
    width = max(len(c.setup.label()) for c in p.candidates) + 2
    lines = [
        f"model     {s.name}: {format_count(s.psi)} trainable parameters"
        + (f" ({format_count(s.frozen_numel)} frozen)" if s.frozen_numel else "")
        + (f", {format_count(s.active_numel)} of them active a token (its top-k experts)"
           if s.idle_expert_numel else "")
        + f", {s.layers} layers, hidden {s.hidden}, {s.heads} heads, vocab {s.vocab}; "
        f"{len(s.unit_numels)} fetch units, largest {format_count(s.largest_unit)}",
        f"hardware  {hw.gpus} GPUs ({hw.nodes} node{'s' * (hw.nodes > 1)}) x "
        f"{format_bytes(hw.gpu_mem_bytes, u)} {u} ({hw.headroom:.0%} usable), interconnect "
        f"{hw.interconnect / 1e9:g} GB/s, PCIe {hw.pcie / 1e9:g} GB/s, NVMe {hw.nvme / 1e9:g} "
        f"GB/s per node, {hw.tflops:g} TFLOPS per GPU assumed" + (
            "; step times from " + hw.calibration.describe() if hw.calibration else ""),
        "memory    planned for " + ("this machine's CPU as the device (calibrated): host memory "
                                    "is the device's, an fp32 gradient is held once"
                                    if hw.device == "cpu" else "GPUs (cuda devices)"),
        f"workload  micro-batch {w.micro_batch} x seq {w.seq} x accumulation {w.gas}, {w.dtype}, "
        f"N_d = {n_d}{f', MP = {w.mp}' if w.mp > 1 else ''}: "
        f"{w.micro_batch * w.seq * w.gas * n_d:,} tokens per step",
        f"activations per GPU: {format_bytes(acts[0], u)} {u} without checkpointing, "
        f"{format_bytes(acts[1], u)} {u} with (paper's rule of thumb 12·h·b·s·L x 2 B = "
        f"{format_bytes(paper, u)} {u})",
        "",
        f"   {'setup':<{width}}{'states':>9}{'activ.':>9}{'buffers':>9}{'GPU ' + u:>10}"
        f"{'host/node':>11}{'nvme/node':>11}{'step s':>20}  fits",
    ]
    for c in p.candidates:
        mark = "*" if c is p.chosen else " "
        buffers = c.states.gathered_params + c.states.comm_buffers
        step = f"{c.time.overlapped:.3g}-{c.time.serial:.3g}"
        lines.append(f" {mark} {c.setup.label():<{width}}" + "".join(
            f"{format_bytes(b, u):>9}" for b in (c.states.model_state_bytes, c.activations.device,
                                                  buffers))
            + f"{format_bytes(c.device_bytes, u):>10}{format_bytes(c.host_bytes * node, u):>11}"
            f"{format_bytes(c.nvme_bytes * node, u):>11}{step:>20}  {'yes' if c.fits else 'no'}")
    lines += ["", f"recommended: {p.chosen.setup.label()}"] + [f"  - {r}" for r in p.reasons]
    return lines
