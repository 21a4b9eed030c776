"""The planner's exact model-state bytes, from a model's real shapes: what the engine
will hold per rank, with its bucketing, padding, partitioning, fetch units, offload
placements and communication buffers (`exact_model_states`), and the activation memory of
a micro-batch. The paper's closed forms on a parameter count Ψ are in estimate.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from zeromem.flat import GradKind, ShardAccumulated, WholeAllReduced, WholeScattered, launch_copies
from zeromem.layout import (GATHER_IN_FLIGHT, REDUCE_IN_FLIGHT, gather_chunks, pack_buckets,
                            padded_numel, peak_in_flight)
from zeromem.offload.budget import pool_unit_numel
from zeromem.planning.host_memory import OffloadBufferSizes, grads_shared, offload_breakdown
from zeromem.stage3.units import UnitCaps, coalesce_target_numel, merge_runs, persistent_groups


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
    as matrices (optim/muon.py `uses_muon`). `idle_expert_numel`: in a mixture of experts,
    the expert elements a token does not pass through (all the experts' but the top-k's
    share), which a step stores but does not compute with.
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
    idle_expert_numel: int = 0

    @property
    def psi(self) -> int:
        return sum(self.param_numels)

    @property
    def active_numel(self) -> int:
        """The elements each token's forward and backward compute with."""
        return self.psi - self.idle_expert_numel

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
    master_bytes = widths.master or widths.param  # 0: the master is the parameter shard
    host, nvme = offload_breakdown([n / n_d for n in padded], optimizer, param, widths.param,
                                   widths.states, per_group, widths.master == 0, layout.offload,
                                   grads_in_file=stage >= 2, frozen=[n / n_d for n in frozen],
                                   master_bytes=master_bytes)
    if "host_grads" in host and grads_shared(layout.device, widths.grad, master_bytes):
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
    """Parameter-width elements per frozen element: an fp32 run keeps the frozen parameters
    in the model's dtype (engine.py `_group_dtype`); 16-bit runs cast them."""
    return shape.frozen_width / widths.param if widths.param == 4 else 1.0


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
