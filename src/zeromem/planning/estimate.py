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

import re
from dataclasses import dataclass

from zeromem.memory import model_state_formula


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
