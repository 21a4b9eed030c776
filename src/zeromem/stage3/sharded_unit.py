"""A stage-3 unit: one flat group's life between optimizer steps (FSDP2's FSDPParamGroup).

Every fetch unit (chosen by units.py) is a flat group whose parameters exist only
as a 1/N_d shard between uses. The group (flat.py) owns the buffers and their
memory state, `GroupState`, as FSDP2's FSDPParam owns its sharded and unsharded
tensors. The `ShardedUnit` owns everything done with them, each in one place:

    unshard / wait / reshard  the all-gather of the whole buffer (plain, hpZ or qwZ)
                              and its release, as the schedule (fetch.py) asks
    gradients                 readiness, counted once per backward: the schedule's
                              hook per parameter calls `grad_in`, which only counts
                              and says when the unit is complete (the schedule then
                              releases it: nothing here calls back up); when the last
                              gradient is in,
                              all of them go into the group's bucket in one copy and
                              the unit hands its reduce-scatter to the shard group's
                              `Comm` it shares with the other units (comm.py), which
                              launches it in group order on every rank (with one
                              bucket at a time, each gradient goes in as it comes).
                              Nothing here knows the optimizer: the step reads the
                              reduced shard from the group.
    phase                     the pass now running (`Phase`): how a gather runs, and
                              whether gradients may arrive

    memory (flat.GroupState)  SHARDED --unshard--> GATHERING --wait--> GATHERED --reshard--> SHARDED
    phase (Phase)             FORWARD | EVAL --start_pass(BACKWARD)--> BACKWARD
                              --last gradient in, or finish_backward--> REDUCED
                              --the engine's backward ends--> FORWARD; a gradient
                              that comes in FORWARD or EVAL (another engine's
                              backward through this module) stays in `param.grad`

How a unit is gathered is a policy chosen once from the config (`GatherPolicy`,
built by hierarchy.build_comm_plan):

- Plain: the unit's shard is all-gathered over the primary group (every shard rank).
- qwZ (ZeRO++ section 3.1): each rank packs its shard as block-wise int8 plus fp32
  scales (hybrid/quantize.py); the packed shards are all-gathered and dequantized into the
  whole buffer, about half the bytes of bf16.
- hpZ (section 3.2): after a training forward's gather, the unit keeps slice
  `position` of the whole buffer, where `position` is its rank in the secondary
  group (a block of h consecutive ranks, normally the node). The block's slices
  together are the whole buffer, so the backward gather runs over the block only and
  never leaves the node. The copy lives from the forward to the optimizer step
  (`new_step` drops it: the step changes the parameters). Being cut from the
  gathered (with qwZ: dequantized) buffer, it gives backward the forward's weights.

Ledger kinds: `all_gather_forward`, `all_gather_eval` (no_grad forwards),
`all_gather_backward`.
"""
from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from zeromem.hybrid import quantize
from zeromem.comm import Comm, Pending
from zeromem.flat import SECOND_GRADIENT, FlatParamGroup, GroupState
from zeromem.offload.params import ParamPlacement, ParamsOnDevice


@dataclass(frozen=True)
class GatherPolicy:
    """How stage-3 units are all-gathered: over which groups, quantized or not."""

    primary: Comm  # every shard rank of the unit
    secondary: Comm | None = None  # hpZ's block of ranks (normally the node); None: off
    weight_bits: int | None = None  # qwZ: 8; None: off
    block: int = 256  # qwZ's quantization block, in elements


class LiveStats:
    """Gathered parameter elements alive now and at peak (stage3_max_live_parameters), and
    the gathers launched since `take_order` last asked, in their order.

    Each rank's k-th all-gather pairs with its peers' k-th: ranks that gather different
    units (a sparse MoE block's experts, each rank running those its data picks) would
    fill them with each other's shards, silently, when the sizes agree. So the engine's
    ranks compare that order at each event of their common log (lockstep.py)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._launched = 0
        self._digest = 0

    def add(self, numel: int) -> None:
        self.live += numel
        self.peak = max(self.peak, self.live)

    def launched(self, index: int, numel: int) -> None:
        """The gather of unit `index` (`numel` elements whole) starts."""
        self.add(numel)
        self._launched += 1
        self._digest = zlib.crc32(index.to_bytes(4, "little"), self._digest)

    def take_order(self) -> str:
        """The gathers launched since the last call, in words, and start counting anew."""
        text = f"{self._launched} gathers (order {self._digest:08x})" if self._launched else ""
        self._launched = self._digest = 0
        return text


class Phase(enum.Enum):
    """The pass a unit is in; assigned in this file only (FSDP2's TrainingState)."""

    FORWARD = "forward"  # a training forward (and between passes): gathers keep hpZ's copy
    EVAL = "eval"  # a no_grad forward (evaluation, generation)
    BACKWARD = "backward"  # gradients arriving; gathers read hpZ's copy
    REDUCED = "reduced"  # this backward's gradients are in the bucket, its launch handed in


class ShardedUnit:
    """One stage-3 flat group's gather, release and gradient reduction, as one object.

    `index` is the group's position in the launch order of `comm` (the shard group's,
    shared by the units: `Comm.reduce_in_order`);
    `persistent` units (under stage3_param_persistence_threshold) stay whole between
    optimizer steps.
    """

    def __init__(self, group: FlatParamGroup, index: int, comm: Comm,
                 persistent: bool, stats: LiveStats, placement: ParamPlacement | None = None,
                 gather: GatherPolicy | None = None):
        self.group = group
        self.index = index
        self.gather = gather or GatherPolicy(comm)  # plain, hpZ or qwZ
        self.placement = placement or ParamsOnDevice()  # where the shard lives between uses
        self.comm = comm  # launches the units' reductions in index order, bounds those alive
        self.persistent = persistent  # small units stay whole (stage3_param_persistence_threshold)
        self.stats = stats
        self.pending: Pending | None = None  # the all-gather while the group is GATHERING
        self.name = group.slots[0].name.rpartition(".")[0] or group.slots[0].name
        self.pins = 0  # GatheredParameters blocks holding the unit whole
        self._phase = Phase.FORWARD
        self.secondary_shard: torch.Tensor | None = None  # hpZ: my slice, forward to step
        self._missing = len(group.params)  # gradients still to come in this backward
        self._offsets = {id(p): slot.offset for p, slot in zip(group.params, group.slots)}
        # With one bucket at a time, gradients may not wait in param.grad beside a reduction
        # in flight (two units' gradients alive): each goes into the bucket as it comes.
        self._eager = comm.one_bucket_at_a_time

    @property
    def state(self) -> GroupState:
        return self.group.state

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def full(self) -> torch.Tensor | None:
        return self.group.full

    def start_pass(self, phase: Phase) -> None:
        """A pass begins: FORWARD or EVAL (how gathers run), or BACKWARD (gradients come)."""
        self._phase = phase
        if phase is Phase.BACKWARD:
            self._missing = len(self.group.params)

    def new_step(self) -> None:
        """The optimizer changed the parameters: the secondary copy is stale."""
        self.secondary_shard = None
        self._phase = Phase.FORWARD

    def held(self) -> list[torch.Tensor]:
        """Tensors the unit holds besides the group's own (hpZ's secondary copy)."""
        return [] if self.secondary_shard is None else [self.secondary_shard]

    # -- gather and release --------------------------------------------------
    # The buffers a gather makes or refills are the parameters training uses next, also
    # when the gather runs under torch.inference_mode (an evaluation; Lightning's
    # validation): made there, they would be inference tensors, which keep no version and
    # which backward refuses to save.
    @torch.inference_mode(False)
    def unshard(self) -> None:
        """Start gathering the whole flat buffer (async)."""
        if self.state is not GroupState.SHARDED:
            return
        g = self.group
        self.placement.fetch(g, self)  # offload_param: the shard comes from host or NVMe first
        full = g.begin_gather()  # the group's own buffer, regrown (flat.py says why)
        self.stats.launched(self.index, g.padded_numel)
        # Backward's saved views of this buffer check its version: refilling it with the
        # same values is not the in-place change that check guards against (also `_finish`).
        with torch.autograd._unsafe_preserve_version_counter(full):
            self.pending = self._launch(full)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until gathered; the parameters are then views of the whole buffer."""
        if self.state is GroupState.SHARDED:
            self.unshard()
        if self.state is GroupState.GATHERING:
            self._finish(timeout_s)
            self.group.finish_gather()

    def reshard(self, force: bool = False, let_go: bool = False) -> None:
        """Drop the whole buffer; parameters become empty again (`let_go`: flat.py)."""
        if self.state is GroupState.SHARDED or ((self.persistent or self.pins) and not force):
            return
        if self.state is GroupState.GATHERING:
            self._finish(None)
        self.group.reshard(let_go)
        self.stats.add(-self.group.padded_numel)

    def _finish(self, timeout_s: float | None) -> None:
        """Wait for the gather in flight; its completion (qwZ's dequantization) writes
        `full` too, which keeps its version for the same reason as `unshard`."""
        full = self.group.full
        assert self.pending is not None and full is not None  # GATHERING: the gather is in flight
        with torch.autograd._unsafe_preserve_version_counter(full):
            self.pending.wait(timedelta(seconds=timeout_s) if timeout_s else None)
        self.pending = None

    def pin(self) -> None:
        """Gather and keep whole until `unpin` (GatheredParameters)."""
        self.pins += 1
        self.wait()

    def unpin(self) -> None:
        self.pins -= 1
        if self.pins == 0:
            self.reshard(let_go=True)  # what the block's user took from it stays theirs

    def check_editable(self) -> None:
        self.group.check_editable()

    def edited(self) -> bool:
        """This rank's part of the whole buffer changed since the gather (GatheredParameters
        edits it). Not told under qwZ, whose gather is an approximation of the shard."""
        return self.state is GroupState.GATHERED and self.gather.weight_bits is None and \
            self.group.whole_edited()

    def adopt_whole(self) -> None:
        """Make the (edited) whole buffer the truth (flat.py), in the shard's own place too:
        host memory, or params.swp, written now (a shard changed outside a step)."""
        self.group.adopt_whole()
        self.placement.store(self.group, 0, self.group.param_shard)
        self.placement.flush()

    # -- gradients ------------------------------------------------------------
    def grad_in(self, param: torch.Tensor) -> bool:
        """A parameter's gradient was accumulated into `param.grad` (its owner's
        post-accumulate-grad hook): count it, nothing more (O(1) per parameter); the last
        one moves them all into the bucket at once. True when this one completed the unit:
        its gradients are handed over, so the whole buffer may go.

        Outside this engine's backward (FORWARD, EVAL: another engine's backward through
        this module) the gradient stays in `param.grad`, as in PyTorch, where `zero_grad()`
        drops it or this engine's next backward takes it in (zero_optimizer.py
        `_take_left_over`)."""
        if self._phase in (Phase.FORWARD, Phase.EVAL):
            return False
        if self._phase is Phase.REDUCED:
            self._late_grad(param)
            return False
        if self._eager:
            self._add_to_bucket(param, first=self._missing == len(self.group.params))
        self._missing -= 1
        if self._missing:
            return False
        self._hand_in()  # BACKWARD -> REDUCED: into the bucket, launched in turn
        return True

    def finish_backward(self) -> None:
        """Backward ended: a unit some gradients never reached (parameters unused on this
        rank) hands in what it has, zeros where nothing came (every rank reduces it). A
        frozen unit has nothing to hand in."""
        if self._phase is Phase.BACKWARD and self.group.trains:
            self._hand_in()

    def _hand_in(self) -> None:
        """Fill the bucket, then hand its reduce-scatter to the comm (launched in turn)."""
        self._fill_bucket()
        self.comm.reduce_in_order(self.index, self.group.launch_reduction)

    def _fill_bucket(self) -> None:
        params = self.group.params
        grads = [p.grad for p in params]
        if any(g is not None for g in grads):
            self.comm.bucket_starts()
            self.group.fill_grads(grads)
            for p in params:
                p.grad = None  # the bucket holds them now
        self._phase = Phase.REDUCED

    def _late_grad(self, param: torch.Tensor) -> None:
        """A gradient after the unit was handed over (a parameter used again, as in
        reentrant activation checkpointing): into the bucket, unless it already left."""
        if self.comm.launched(self.index):
            raise RuntimeError(f"parameter of unit '{self.name}' {SECOND_GRADIENT}")
        self._add_to_bucket(param, first=True)

    def _add_to_bucket(self, param: torch.Tensor, first: bool) -> None:
        assert param.grad is not None  # called by the post-accumulate-grad hook
        if first:
            self.comm.bucket_starts()
        self.group.add_grad(self._offsets[id(param)], param.grad)
        param.grad = None

    # -- the collective -----------------------------------------------------
    def _launch(self, full: torch.Tensor) -> Pending:
        """Start gathering the group's whole buffer into `full` (async), as the policy says."""
        backward = self._phase in (Phase.BACKWARD, Phase.REDUCED)
        policy = self.gather
        kind = "all_gather_backward" if backward else f"all_gather_{self._phase.value}"
        secondary = self.secondary_shard
        if backward and secondary is not None:
            assert policy.secondary is not None  # copies exist only with hpZ on
            return policy.secondary.all_gather(full, secondary, async_op=True, kind=kind)
        shard = self.group.param_shard
        if policy.weight_bits is None:
            pending = policy.primary.all_gather(full, shard, async_op=True, kind=kind)
            finish = None
        else:
            pending, finish = all_gather_quantized(policy.primary, shard, full, kind,
                                                   policy.weight_bits, policy.block)
        keep = self._phase is Phase.FORWARD and policy.secondary is not None
        inner = pending.finish  # Comm's own finishing step (the comms_logger's record)

        def done() -> None:
            if inner is not None:
                inner()
            if finish is not None:
                finish()
            if keep:
                self._keep_secondary(full)

        return Pending(pending.work, done, pending.explain, pending.forget)

    def _keep_secondary(self, full: torch.Tensor) -> None:
        secondary = self.gather.secondary
        assert secondary is not None
        size = full.numel() // secondary.world_size  # padded_numel is a multiple of N
        start = secondary.rank * size
        self.secondary_shard = full[start:start + size].clone()


def all_gather_quantized(comm: Comm, shard: torch.Tensor, full: torch.Tensor, kind: str,
                         bits: int, block: int) -> tuple[Pending, Callable[[], None]]:
    """qwZ: all-gather the packed int8 shards; `finish` dequantizes them into `full`."""
    n, numel = comm.world_size, shard.numel()
    packed = quantize.pack(shard.view(1, -1), bits, block).view(-1)
    out = torch.empty(n * packed.numel(), dtype=torch.uint8, device=shard.device)
    pending = comm.all_gather(out, packed, async_op=True, kind=kind)

    def finish() -> None:
        rows = quantize.unpack(out.view(n, -1), numel, bits, block, full.dtype)
        full.view(n, numel).copy_(rows)

    return pending, finish
