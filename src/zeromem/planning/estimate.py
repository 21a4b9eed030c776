"""Per-device model-state memory by ZeRO stage, from the paper's formulas (ZeRO section 5).

Pure arithmetic on a parameter count Ψ: no model, no tensors. With 16-bit
parameters and gradients (2 + 2 bytes) and K bytes of fp32 master weights plus
optimizer states per parameter (K = 12 for mixed-precision Adam), one device of
N_d data-parallel ranks holds

    stage 0  (baseline)   (2 + 2 + K) Ψ
    stage 1  P_os         (2 + 2) Ψ + K Ψ / N_d
    stage 2  P_os+g       2 Ψ + (2 + K) Ψ / N_d
    stage 3  P_os+g+p     (2 + 2 + K) Ψ / N_d

(`memory.model_state_formula`, the same function the engine's ledger compares
against). GB means 1e9 bytes, as in the paper; that is what reproduces Table 1
(7.5B at N_d = 64: 120 / 31.4 / 16.6 / 1.88 GB) and Table 2 (the largest model
whose model states fit a 32 GB GPU). With model parallelism of degree MP each
device holds Ψ / MP of the parameters before ZeRO partitions them further.

Offload (ZeRO-Offload / ZeRO-Infinity), a per-rank move of bytes off the device:
`offload_optimizer` moves the master weights and optimizer states (K Ψ / N_d per
rank, stages >= 1) to host memory or NVMe; `offload_param` (stage 3 only) moves the
16-bit parameter shard (2 Ψ / N_d) too. Gradients stay where the stage puts them.

`deepspeed_estimate` evaluates DeepSpeed's own published estimator formulas
(REFERENCE.md 2.7: 2 resident + 18 partitioned bytes per parameter, a 1.5 host
buffer factor), which count more than the paper (an fp32 gradient copy), so the
two can be compared side by side.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from zeromem.layout import (GATHER_IN_FLIGHT, REDUCE_IN_FLIGHT, gather_chunks, pack_buckets,
                            padded_numel, peak_in_flight)
from zeromem.memory import model_state_formula
from zeromem.flat import (GradKind, ShardAccumulated, WholeAllReduced, WholeScattered,
                          launch_copies)
from zeromem.offload.budget import pool_unit_numel
from zeromem.planning.host_memory import OffloadBufferSizes, grads_shared, offload_breakdown
from zeromem.stage3.units import UnitCaps, coalesce_target_numel, merge_runs, persistent_groups

UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
         "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}
_COUNT_SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
STAGE_NAMES = {0: "baseline DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
STAGE_FORMULAS = {0: "(2+2+K)Ψ", 1: "(2+2)Ψ + KΨ/N_d", 2: "2Ψ + (2+K)Ψ/N_d", 3: "(2+2+K)Ψ/N_d"}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
PLACE_OF_DEVICE = {"cpu": "host", "nvme": "nvme"}
OPTIMIZER_CATEGORIES = ("master_params", "optimizer_states")


# ---------------------------------------------------------------- parsing and printing

def parse_count(text: str | float) -> float:
    """A parameter count: 7.5e9, "7.5e9", "7.5B", "350M", "1T" (B = billion)."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*", str(text), re.I)
    if not match:
        raise ValueError(f"not a parameter count: {text!r} (try 7.5e9 or 7.5B)")
    return float(match.group(1)) * _COUNT_SUFFIXES[match.group(2).upper()]


def parse_bytes(text: str | float, default_unit: str = "GB") -> float:
    """A size in bytes: "32GB", "80GiB", "32" (in `default_unit`); a number is bytes."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([KMGT]?i?B)?\s*", str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (try 32GB or 80GiB)")
    unit = match.group(2) or default_unit
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r} in {text!r}; use one of {', '.join(UNITS)}")
    return float(match.group(1)) * UNITS[unit]


def format_bytes(nbytes: float, unit: str = "GB") -> str:
    """`nbytes` in `unit`, with three significant digits at least."""
    value = nbytes / UNITS[unit]
    digits = 2 if abs(value) >= 1 or value == 0 else 3 if abs(value) >= 0.1 else 4
    return f"{value:,.{digits}f}"


def format_count(count: float) -> str:
    """7.5e9 -> "7.5B", 1.28e11 -> "128B", 2e12 -> "2T"."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return f"{count:.3g}"


# ---------------------------------------------------------------- the paper's model

@dataclass(frozen=True)
class StageEstimate:
    """Model-state bytes of one rank at one stage: per category on the device, and off it."""

    stage: int
    device: dict[str, float]
    host_bytes: float = 0.0
    nvme_bytes: float = 0.0
    fits: bool | None = None  # device bytes <= GPU memory; None when no GPU memory was given
    note: str = ""

    @property
    def device_bytes(self) -> float:
        return sum(self.device.values())


def stage_memory(psi: float, n_d: int, stage: int, k: int = 12, param_bytes: int = 2,
                 grad_bytes: int = 2, offload_optimizer: str = "none",
                 offload_param: str = "none") -> StageEstimate:
    """One rank's model states at `stage` for `psi` parameters per model-parallel rank."""
    device = dict(model_state_formula(psi, n_d, stage, param_bytes, grad_bytes, k))
    off = {"host": 0.0, "nvme": 0.0}
    notes = []
    moves = [(offload_optimizer, OPTIMIZER_CATEGORIES, 1, "optimizer offload needs stage >= 1"),
             (offload_param, ("params",), 3, "parameter offload needs stage 3")]
    for where, categories, min_stage, refusal in moves:
        if where == "none":
            continue
        if where not in PLACE_OF_DEVICE:
            raise ValueError(f"offload device must be one of {OFFLOAD_DEVICES}, got {where!r}")
        if stage < min_stage:
            notes.append(refusal)
            continue
        for category in categories:
            off[PLACE_OF_DEVICE[where]] += device.pop(category)
    return StageEstimate(stage, device, off["host"], off["nvme"], note="; ".join(notes))


def bytes_per_param(n_d: int, stage: int, k: int = 12, param_bytes: int = 2, grad_bytes: int = 2,
                    offload_optimizer: str = "none", offload_param: str = "none") -> float:
    """Device bytes per parameter (of one model-parallel rank) at `stage`."""
    return stage_memory(1.0, n_d, stage, k, param_bytes, grad_bytes, offload_optimizer,
                        offload_param).device_bytes


def max_params(gpu_mem_bytes: float, n_d: int, stage: int, mp: int = 1, k: int = 12,
               param_bytes: int = 2, grad_bytes: int = 2, offload_optimizer: str = "none",
               offload_param: str = "none") -> float:
    """Largest Ψ whose model states fit `gpu_mem_bytes` per device (paper Table 2)."""
    per_param = bytes_per_param(n_d, stage, k, param_bytes, grad_bytes, offload_optimizer,
                                offload_param)
    return float("inf") if per_param == 0 else gpu_mem_bytes * mp / per_param


@dataclass(frozen=True)
class Estimate:
    """Per-device model-state memory for stages 0-3, as `zeromem estimate` prints it."""

    params: float
    dp: int
    mp: int
    k: int
    param_bytes: int
    grad_bytes: int
    gpu_mem_bytes: float | None
    units: str
    offload_optimizer: str
    offload_param: str
    gpus_per_node: int
    stages: tuple[StageEstimate, ...]

    @property
    def fits(self) -> dict[int, bool | None]:
        """Stage -> whether its device bytes fit the GPU memory (None without one)."""
        return {s.stage: s.fits for s in self.stages}

    @property
    def device_bytes(self) -> dict[int, float]:
        return {s.stage: s.device_bytes for s in self.stages}

    def max_params(self) -> dict[int, float]:
        """Stage -> the largest model that fits the GPU memory with these N_d, MP, K and offload."""
        if self.gpu_mem_bytes is None:
            return {}
        return {s.stage: max_params(self.gpu_mem_bytes, self.dp, s.stage, self.mp, self.k,
                                    self.param_bytes, self.grad_bytes, self.offload_optimizer,
                                    self.offload_param) for s in self.stages}

    def __str__(self) -> str:
        u = self.units
        offloading = self.offload_optimizer != "none" or self.offload_param != "none"
        mp = f", MP = {self.mp}" if self.mp > 1 else ""
        lines = [f"model states per device: Ψ = {format_count(self.params)} parameters, "
                 f"N_d = {self.dp}{mp}, K = {self.k}, {self.param_bytes}-byte params, "
                 f"{self.grad_bytes}-byte grads (1 {u} = {UNITS[u]:.4g} bytes)"]
        head = f"{'stage':<7}{'partitions':<13}{'formula':<19}{'device ' + u:>12}"
        if offloading:
            head += f"{'host ' + u:>12}{'nvme ' + u:>12}"
        if self.gpu_mem_bytes is not None:
            head += f"   fits {format_bytes(self.gpu_mem_bytes, u)} {u}"
        lines.append(head)
        for s in self.stages:
            row = (f"{s.stage:<7}{STAGE_NAMES[s.stage]:<13}{STAGE_FORMULAS[s.stage]:<19}"
                   f"{format_bytes(s.device_bytes, u):>12}")
            if offloading:
                row += f"{format_bytes(s.host_bytes, u):>12}{format_bytes(s.nvme_bytes, u):>12}"
            if s.fits is not None:
                row += f"   {'yes' if s.fits else 'no'}"
            lines.append(row + (f"   ({s.note})" if s.note else ""))
        if offloading:
            node = self.gpus_per_node
            lines.append(f"off-device bytes are per rank; per node of {node} GPUs multiply by {node}")
        largest = self.max_params()
        if largest and self.gpu_mem_bytes is not None:
            lines.append(f"largest model whose states fit {format_bytes(self.gpu_mem_bytes, u)} {u}: "
                         + " / ".join(f"stage {s}: {format_count(n)}" for s, n in largest.items()))
        return "\n".join(lines)


def estimate(params: float | str, dp: int, k: int = 12, gpu_mem: float | str | None = None,
             units: str = "GB", offload: str | None = None, offload_param: str | None = None,
             mp: int = 1, param_bytes: int = 2, grad_bytes: int = 2,
             gpus_per_node: int = 8) -> Estimate:
    """Per-device model-state memory for stages 0-3 from the paper's formulas.

    `params`: Ψ, a number or "7.5B"; `dp`: N_d; `gpu_mem`: bytes, or a string such as
    "32GB" ("32" means 32 `units`); `offload` ("cpu" | "nvme"): where master weights and
    optimizer states go (stages >= 1); `offload_param`: where stage 3's parameter shards
    go; `mp`: model-parallel degree (each device holds Ψ / mp before ZeRO).
    """
    if units not in UNITS:
        raise ValueError(f"units must be one of {', '.join(UNITS)}, got {units!r}")
    if dp < 1 or mp < 1:
        raise ValueError(f"dp and mp must be >= 1, got dp={dp}, mp={mp}")
    psi = parse_count(params)
    mem = None if gpu_mem is None else parse_bytes(gpu_mem, units)
    off_opt, off_param = offload or "none", offload_param or "none"
    stages = []
    for stage in range(4):
        s = stage_memory(psi / mp, dp, stage, k, param_bytes, grad_bytes, off_opt, off_param)
        fits = None if mem is None else s.device_bytes <= mem
        stages.append(StageEstimate(stage, s.device, s.host_bytes, s.nvme_bytes, fits, s.note))
    return Estimate(psi, dp, mp, k, param_bytes, grad_bytes, mem, units, off_opt, off_param,
                    gpus_per_node, tuple(stages))


# ---------------------------------------------------------------- DeepSpeed's estimator

@dataclass(frozen=True)
class DeepSpeedEstimate:
    """DeepSpeed's published estimate: bytes per GPU and per node's CPU memory."""

    gpu_bytes: float
    cpu_bytes: float


def deepspeed_estimate(psi: float, largest_layer: float, stage: int, gpus_per_node: int = 1,
                       nodes: int = 1, offload_optimizer: bool = False,
                       offload_param: bool = False, zero_init: bool = True,
                       buffer_factor: float = 1.5) -> DeepSpeedEstimate:
    """DeepSpeed's estimator formulas (REFERENCE.md 2.7), written from the published table.

    18 bytes per parameter are partitioned (16-bit grad, fp32 grad, fp32 param, Adam m
    and v) besides the 2-byte 16-bit parameter; stage 3 keeps four bytes per element of
    the largest layer on the GPU; host figures carry a 1.5 buffer factor. Stages 1 and 2
    share one formula.
    """
    total_gpus = gpus_per_node * nodes
    if stage in (1, 2):
        if offload_optimizer:
            return DeepSpeedEstimate(2 * psi, psi * max(4 * total_gpus, 16) * buffer_factor)
        return DeepSpeedEstimate(2 * psi + 18 * psi / total_gpus,
                                 4 * psi * gpus_per_node * buffer_factor)
    if stage != 3:
        raise ValueError(f"DeepSpeed's estimator covers stages 1-3, got {stage}")
    working = 4 * largest_layer
    if offload_param:
        gpu, offloaded = working, 18 * psi / nodes
    elif offload_optimizer:
        gpu, offloaded = working + 2 * psi / total_gpus, 16 * psi / nodes
    else:
        gpu, offloaded = working + 18 * psi / total_gpus, 0.0
    # Without zero.Init every process first builds the whole fp32 model on the host.
    resident = (working if zero_init else 4 * psi) * gpus_per_node
    return DeepSpeedEstimate(gpu, max(resident, offloaded) * buffer_factor)


# ---------------------------------------------------------------- exact, from real shapes

@dataclass(frozen=True)
class UnmergedUnit:
    """A default fetch unit before merging (stage3/units.py `unmerged_units`), in module order."""

    first: int  # registration index of its first parameter: the engine orders groups by it
    numel: int
    shared: bool = False  # holds a tied parameter: never merged


def merged_unit_numels(unmerged: tuple[UnmergedUnit, ...], caps: UnitCaps) -> tuple[int, ...]:
    """Elements of each merged unit (the engine's `coalesce`, then `merge_persistent`), in
    the engine's group order."""
    numels = [u.numel for u in unmerged]
    target = coalesce_target_numel(sum(numels), caps, max(numels, default=0))
    runs = merge_runs(numels, [u.shared for u in unmerged], target)
    units = [(min(unmerged[i].first for i in run), sum(numels[i] for i in run)) for run in runs]
    groups = persistent_groups([n for _, n in units], caps)  # then `merge_persistent`
    units = [(min(units[i][0] for i in g), sum(units[i][1] for i in g)) for g in groups]
    return tuple(n for _, n in sorted(units, key=lambda u: -u[0]))


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: parameter sizes, fetch units and dimensions.

    `param_numels` are the trainable parameters in registration order, a tied weight
    once (as `module.parameters()` yields them); `unit_numels` the trainable elements of
    each stage-3 fetch unit, as the engine chooses them by default (stage3/units.py), in
    the engine's group order (latest-registered first: the order backward reaches them).
    `unmerged` (from `shape_of`; empty in a shape built by hand) are those units before
    merging, from which `with_unit_caps` merges them again under a run's caps.
    `frozen_unit_numels` / `frozen_unmerged`: the same for the parameters frozen at
    `initialize`, which stage 3 shards in units of their own (none in a shape built by
    hand: then `frozen_numel` counts as one such unit). `frozen_width`: their bytes per
    element as the model holds them, which an fp32 run keeps (a precision block casts
    them to its own). `muon_numel`: the trainable elements the config's Muon would step
    as matrices (optim/muon.py `uses_muon`).
    """

    name: str
    param_numels: tuple[int, ...]
    frozen_numel: int
    unit_numels: tuple[int, ...]
    layers: int
    hidden: int
    heads: int
    vocab: int
    intermediate: int
    positions: int | None = None
    unmerged: tuple[UnmergedUnit, ...] = ()
    frozen_unit_numels: tuple[int, ...] = ()
    frozen_unmerged: tuple[UnmergedUnit, ...] = ()
    frozen_width: float = 4.0
    muon_numel: int = 0

    @property
    def psi(self) -> int:
        return sum(self.param_numels)

    def with_unit_caps(self, caps: UnitCaps) -> ModelShape:
        """This shape with its fetch units merged as the engine merges them under `caps`."""
        if not self.unmerged:
            return self
        return dataclasses.replace(
            self, unit_numels=merged_unit_numels(self.unmerged, caps),
            frozen_unit_numels=merged_unit_numels(self.frozen_unmerged, caps))

    @property
    def frozen_units(self) -> tuple[int, ...]:
        """Elements of each stage-3 unit of frozen parameters."""
        if self.frozen_unit_numels or not self.frozen_numel:
            return self.frozen_unit_numels
        return (self.frozen_numel,)

    @property
    def largest_unit(self) -> int:
        return max(self.unit_numels, default=0)


@dataclass(frozen=True)
class Widths:
    """Bytes per element of each kind of model state (mixed-precision Adam by default)."""

    param: int = 2
    grad: int = 2
    master: int = 4  # 0 when training in fp32: the master aliases the parameters
    states: float = 8  # Adam m and v (Muon's: fewer on average, one for its matrices)
    scalars_per_group: int = 4  # torch Adam's `step`: one fp32 scalar per flat group

    @property
    def k(self) -> float:
        return self.master + self.states


@dataclass(frozen=True)
class ZeroLayout:
    """The config knobs that decide how parameters are grouped, padded and partitioned."""

    stage: int
    reduce_bucket_numel: int = 500_000_000
    allgather_bucket_numel: int = 500_000_000
    persistence_threshold: int = 100_000
    prefetch_numel: int = 50_000_000
    offload_optimizer: str = "none"
    offload_param: str = "none"
    offload: OffloadBufferSizes = OffloadBufferSizes()  # swap-buffer sizes (sub_group_size, buffer_count)
    overlap_comm: bool | None = None  # None: as the config's default, on at stage 3 only
    backend: str = "nccl"  # the collectives' backend: gloo stages reduce-scatters in a copy
    # where the ranks compute: "cuda" (a plan for GPUs), or "cpu" (this machine: host memory
    # is the device's, so what the engine keeps once there is counted once)
    device: str = "cuda"

    def unit_caps(self, param_bytes: int, n_d: int) -> UnitCaps:
        """What bounds a merged fetch unit, as the engine's `_unit_caps` reads it: the reduce
        bucket, and with parameters on NVMe the parameter pool's share of the host budget."""
        pool = None
        if self.stage >= 3 and self.offload_param == "nvme":
            pool = pool_unit_numel(self.offload.host_budget_bytes,
                                   self.offload.param_buffer_count, param_bytes, n_d)
        return UnitCaps(self.reduce_bucket_numel, pool, self.persistence_threshold)


def reduce_buckets(param_numels: tuple[int, ...], bucket_numel: int) -> list[int]:
    """Bucket sizes as the engine packs them: reverse registration order, <= bucket_numel each."""
    numels = list(reversed(param_numels))
    return [sum(numels[i] for i in bucket) for bucket in pack_buckets(numels, bucket_numel)]


@dataclass(frozen=True)
class ShapeMemory:
    """One rank's bytes computed from real shapes: model states by category, and the rest."""

    device: dict[str, float]  # params, grads, master_params, optimizer_states
    host_bytes: float
    nvme_bytes: float
    gathered_params: float  # stage 3: peak of whole parameters gathered for compute
    comm_buffers: float  # temporary reduce / all-gather buffers at their peak (sum of `comm`)
    groups: int
    host: dict[str, float] = field(default_factory=dict)  # host bytes by name (host_memory.py)
    nvme: dict[str, float] = field(default_factory=dict)  # NVMe bytes by name
    comm: dict[str, float] = field(default_factory=dict)  # comm_buffers by name, at the peak

    @property
    def model_state_bytes(self) -> float:
        return sum(self.device.values())

    def scaled(self, factor: float) -> ShapeMemory:
        """Every byte count times `factor` (a model-parallel rank's share)."""
        if factor == 1:
            return self
        return ShapeMemory({c: b * factor for c, b in self.device.items()},
                           self.host_bytes * factor, self.nvme_bytes * factor,
                           self.gathered_params * factor, self.comm_buffers * factor, self.groups,
                           {k: b * factor for k, b in self.host.items()},
                           {k: b * factor for k, b in self.nvme.items()},
                           {k: b * factor for k, b in self.comm.items()})


def _group_numels(shape: ModelShape, layout: ZeroLayout) -> list[int]:
    """Elements of each flat group: a fetch unit at stage 3, else a reduce bucket."""
    if layout.stage >= 3:
        return list(shape.unit_numels)
    return reduce_buckets(shape.param_numels, layout.reduce_bucket_numel)


def rank_shards(shape: ModelShape, n_d: int, layout: ZeroLayout) -> list[float]:
    """Elements of each flat group's shard on one rank, in the engine's group order."""
    return [padded_numel(n, n_d) / n_d for n in _group_numels(shape, layout)]


def exact_model_states(shape: ModelShape, n_d: int, widths: Widths, layout: ZeroLayout) -> ShapeMemory:
    """Per-rank memory from `shape` with the engine's bucketing, padding and partitioning.

    Stages 0-2: one flat group per reduce bucket. Stage 3: one flat group per fetch
    unit; units under `stage3_param_persistence_threshold` also stay gathered, and at
    most the largest unit plus one prefetch bucket is gathered at a time. Ranks computing
    on the CPU (`layout.device`) hold an fp32 gradient once where a GPU run holds a
    device and a host copy (optimizer on the host).
    """
    stage = layout.stage
    sizes = _group_numels(shape, layout)
    padded = [padded_numel(n, n_d) for n in sizes]
    whole = sum(padded)
    shard = whole / n_d
    persistent = sum(padded_numel(n, n_d) for n in sizes if n < layout.persistence_threshold) \
        if stage >= 3 else 0
    # stage 3 shards the frozen parameters too, in units of their own (small ones whole);
    # counted below in elements of the parameters' width
    scale = frozen_scale(shape, widths)
    frozen = [padded_numel(n, n_d) * scale for n in shape.frozen_units] if stage >= 3 else []
    frozen_shard = sum(frozen) / n_d
    frozen_kept = sum(padded_numel(n, n_d) * scale for n in shape.frozen_units
                      if n < layout.persistence_threshold) if stage >= 3 else 0
    per_group = widths.scalars_per_group * len(padded)
    device = {
        "params": widths.param * (shard + persistent + frozen_shard + frozen_kept if stage >= 3
                                  else whole + shape.frozen_numel * scale),
        "grads": widths.grad * (shard if stage >= 2 else whole),
        "master_params": widths.master * (shard if stage >= 1 else whole),
        "optimizer_states": widths.states * (shard if stage >= 1 else whole) + per_group,
    }
    optimizer = layout.offload_optimizer if stage >= 1 else "none"
    param = layout.offload_param if stage >= 3 else "none"
    if optimizer != "none":
        del device["master_params"], device["optimizer_states"]
    if param != "none":
        device["params"] -= widths.param * (shard + frozen_shard)
        if optimizer == "none" and widths.master == 0:
            # fp32 with the optimizer on the device: the master was the parameter shard,
            # which now leaves memory, so the engine keeps a device master of its own
            # (offload/masters.py MastersOnDevice)
            device["master_params"] = widths.param * shard
    if optimizer == "nvme" and stage >= 2:
        device["grads"] = 0.0  # each reduced shard goes to grads.swp (offload/grad_file.py)
    host, nvme = offload_breakdown([n / n_d for n in padded], optimizer, param, widths.param,
                                   widths.states, per_group, widths.master == 0, layout.offload,
                                   grads_in_file=stage >= 2, frozen=[n / n_d for n in frozen])
    if "host_grads" in host and grads_shared(layout.device, widths.grad):
        # the reduced gradient is the host gradient (HostGrads reads it where it is): its
        # buffer (the whole gradient at stage 1, the shards at 2-3) held once, on the host,
        # where the engine's ledger files it
        host["host_grads"], device["grads"] = device["grads"], 0.0
    comm = comm_buffer_parts(padded, n_d, widths, layout)
    return ShapeMemory(device, sum(host.values()), sum(nvme.values()),
                       _gathered_bytes(sizes + [round(n * scale) for n in shape.frozen_units],
                                       n_d, widths, layout),
                       sum(comm.values()),
                       len(padded), host, nvme, comm)


def frozen_scale(shape: ModelShape, widths: Widths) -> float:
    """Parameter-width elements per frozen element: an fp32 run (no master of its own) keeps
    the frozen parameters in the model's dtype (engine.py `_group_dtype`)."""
    return shape.frozen_width / widths.param if widths.master == 0 else 1.0


def _gathered_bytes(sizes: list[int], n_d: int, widths: Widths, layout: ZeroLayout) -> float:
    """Stage 3: the unit in use plus up to one prefetch bucket of the next ones."""
    if layout.stage < 3:
        return 0.0
    gathered = [padded_numel(n, n_d) for n in sizes if n >= layout.persistence_threshold]
    if not gathered:
        return 0.0
    return widths.param * min(sum(gathered), max(gathered) + layout.prefetch_numel)


GRAD_KINDS: dict[int, GradKind] = {0: WholeAllReduced, 1: WholeScattered, 2: ShardAccumulated,
                                   3: ShardAccumulated}  # as the engine picks them by stage


def comm_buffer_parts(padded: list[int], n_d: int, widths: Widths,
                      layout: ZeroLayout) -> dict[str, float]:
    """The temporary communication buffers (CB) at their peak, by name, as the engine
    allocates and notes them (Comm.note_buffer): the larger of two phases.

    Reduction (backward): each bucket's launch holds `flat.launch_copies` full-size
    buffers, the temporary bucket (stages 2-3, `grad_buckets`) and the backend's receive
    buffer (`reduce_scatter_receive`: gloo's all-to-all lands the chunks there; NCCL has
    none), for REDUCE_IN_FLIGHT consecutive buckets under overlap_comm, else (and when the
    optimizer on NVMe sends reduced shards to grads.swp) one.
    Parameter all-gather (after the step, stages 1-2): the chunk buffers of groups over
    `allgather_bucket_size` (`layout.gather_chunks`), GATHER_IN_FLIGHT + 1 alive at once
    (the next is allocated before the oldest is waited on); a group within the bucket is
    gathered in place. Stage 3 gathers into the parameters' own full buffers
    (`gathered_params`), not here.
    """
    stage = layout.stage
    overlap = layout.overlap_comm if layout.overlap_comm is not None else stage >= 3
    # reduced shards to grads.swp (optimizer on NVMe, stages 2-3): two buckets alive, one
    # reducing and one filling (offload/masters.py MastersOnNvme.buckets_alive): a launch
    # waits for the reduction before it, so one bucket's buffers are noted at a time
    to_file = layout.offload_optimizer == "nvme" and stage >= 2
    window = peak_in_flight(padded, REDUCE_IN_FLIGHT if overlap and not to_file else 1) \
        * widths.grad
    kind = GRAD_KINDS[stage]
    received = launch_copies(kind, layout.backend) - kind.temporary_buckets if n_d > 1 else 0
    reduce = {"grad_buckets": kind.temporary_buckets * window,
              "reduce_scatter_receive": received * window}  # one rank copies, sends nothing
    chunks: list[int] = []
    if 1 <= stage <= 2:
        for n in padded:
            chunks += [n_d * (end - start)
                       for start, end in gather_chunks(n, n_d, layout.allgather_bucket_numel)] or [0]
    gather = widths.param * peak_in_flight(chunks, GATHER_IN_FLIGHT + 1)
    parts = reduce if sum(reduce.values()) >= gather else {"gather_chunks": gather}
    return {name: float(b) for name, b in parts.items() if b}


# ---------------------------------------------------------------- activations

@dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes of one rank for one micro-batch."""

    device: float
    host: float
    per_layer: float  # everything one layer saves for backward
    checkpoints: float  # the stored layer inputs, when checkpointing


def activation_memory(shape: ModelShape, micro_batch: int, seq: int, value_bytes: int = 2,
                      checkpointing: bool = False, mp: int = 1, partition: bool = False,
                      cpu: bool = False, flash: bool = False) -> ActivationMemory:
    """Activation memory from Korthikanti et al. 2022 ("Reducing Activation Recomputation").

    One transformer layer saves s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes with 16-bit values
    and 1-byte dropout masks, t being the tensor-parallel degree (34 + 5as/h for t = 1);
    the 5as/h term is the attention score matrices, which fused (flash) attention never
    stores. fp32 values double it. Add the output head: 16-bit logits plus the fp32
    copy the loss is computed in, s·b·V·(value_bytes + 4).

    Checkpointing keeps one layer input (s·b·h values) per layer and, during backward,
    one layer's full activations being recomputed. Pa divides the checkpoints by the
    model-parallel degree (a no-op at mp = 1); Pa+cpu moves them to host memory.
    """
    sbh = seq * micro_batch * shape.hidden
    t = max(1, mp)
    attention = 0.0 if flash else 5 * shape.heads * seq / (shape.hidden * t)
    per_layer = sbh * (10 + 24 / t + attention) * value_bytes / 2
    head = seq * micro_batch * shape.vocab * (value_bytes + 4)
    if not checkpointing:
        return ActivationMemory(shape.layers * per_layer + head, 0.0, per_layer, 0.0)
    checkpoints = shape.layers * sbh * value_bytes / (t if partition else 1)
    on_host = checkpoints if cpu else 0.0
    return ActivationMemory(checkpoints - on_host + per_layer + head, on_host, per_layer, checkpoints)


def paper_activation_bytes(hidden: int, batch: int, seq: int, layers: int) -> float:
    """The ZeRO paper's rule of thumb (section 3.2): 12·h·b·s·L values of 2 bytes."""
    return 12 * hidden * batch * seq * layers * 2
