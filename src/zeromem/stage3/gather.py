"""A stage-3 fetch unit: one flat group gathered whole (plainly, from hpZ's copy, or quantized).

Every fetch unit (chosen by units.py) is a flat group whose parameters exist only
as a 1/N_d shard between uses. The group owns the gathered buffer and an explicit
state (flat.py, `GroupState`); a `FetchUnit` issues the all-gather and owns what
gathering needs: the collective in flight, its hpZ secondary copy, where the shard
lives between uses, whether it stays whole. The schedule (fetch.py) decides when:

    SHARDED --unshard(async)--> GATHERING --wait--> GATHERED --reshard--> SHARDED

How a unit is gathered is a policy chosen once from the config (`GatherPolicy`,
built by hierarchy.build_comm_plan):

- Plain: the unit's shard is all-gathered over the primary group (every shard rank).
- qwZ (ZeRO++ section 3.1): each rank packs its shard as block-wise int8 plus fp32
  scales (quantize.py); the packed shards are all-gathered and dequantized into the
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

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from zeromem import quantize
from zeromem.comm import Comm, Pending
from zeromem.flat import FlatParamGroup, GroupState
from zeromem.offload.params import ParamPlacement, ParamsOnDevice


@dataclass(frozen=True)
class GatherPolicy:
    """How stage-3 units are all-gathered: over which groups, quantized or not."""

    primary: Comm  # every shard rank of the unit
    secondary: Comm | None = None  # hpZ's block of ranks (normally the node); None: off
    weight_bits: int | None = None  # qwZ: 8; None: off
    block: int = 256  # qwZ's quantization block, in elements


class LiveStats:
    """Gathered parameter elements alive now and at peak (stage3_max_live_parameters)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, numel: int) -> None:
        self.live += numel
        self.peak = max(self.peak, self.live)


class FetchUnit:
    """One stage-3 flat group's gather and release, as the schedule (fetch.py) asks."""

    def __init__(self, group: FlatParamGroup, comm: Comm, persistent: bool, stats: LiveStats,
                 placement: ParamPlacement | None = None, gather: GatherPolicy | None = None):
        self.group = group
        self.gather = gather or GatherPolicy(comm)  # plain, hpZ or qwZ
        self.placement = placement or ParamsOnDevice()  # where the shard lives between uses
        self.comm = comm
        self.persistent = persistent  # small units stay whole (stage3_param_persistence_threshold)
        self.stats = stats
        self.pending: Pending | None = None  # the all-gather while the group is GATHERING
        self.name = group.slots[0].name.rpartition(".")[0] or group.slots[0].name
        self.pins = 0  # GatheredParameters blocks holding the unit whole
        self.phase = "forward"  # the pass now running: "forward", "eval" or "backward"
        self.secondary_shard: torch.Tensor | None = None  # hpZ: my slice, forward to step

    @property
    def state(self) -> GroupState:
        return self.group.state

    @property
    def full(self) -> torch.Tensor | None:
        return self.group.full

    def start_pass(self, phase: str) -> None:
        """"forward", "eval" or "backward": backward gathers from the secondary copy."""
        self.phase = phase

    def new_step(self) -> None:
        """The optimizer changed the parameters: the secondary copy is stale."""
        self.secondary_shard = None
        self.phase = "forward"

    def held(self) -> list[torch.Tensor]:
        """Tensors the unit holds besides the group's own (hpZ's secondary copy)."""
        return [] if self.secondary_shard is None else [self.secondary_shard]

    def unshard(self) -> None:
        """Start gathering the whole flat buffer (async)."""
        if self.state is not GroupState.SHARDED:
            return
        g = self.group
        self.placement.fetch(g, self)  # offload_param: the shard comes from host or NVMe first
        full = g.begin_gather()  # the group's own buffer, regrown (flat.py says why)
        self.stats.add(g.padded_numel)
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

    def reshard(self, force: bool = False) -> None:
        """Drop the whole buffer; parameters become empty again."""
        if self.state is GroupState.SHARDED or ((self.persistent or self.pins) and not force):
            return
        if self.state is GroupState.GATHERING:
            self._finish(None)
        self.group.reshard()
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
            self.reshard()

    def adopt_whole(self) -> None:
        """Make the (edited) whole buffer the truth (flat.py)."""
        self.group.adopt_whole()

    # -- the collective -----------------------------------------------------
    def _launch(self, full: torch.Tensor) -> Pending:
        """Start gathering the group's whole buffer into `full` (async), as the policy says."""
        policy, kind = self.gather, f"all_gather_{self.phase}"
        secondary = self.secondary_shard
        if self.phase == "backward" and secondary is not None:
            assert policy.secondary is not None  # copies exist only with hpZ on
            return policy.secondary.all_gather(full, secondary, async_op=True, kind=kind)
        shard = self.group.param_shard
        if policy.weight_bits is None:
            pending = policy.primary.all_gather(full, shard, async_op=True, kind=kind)
            finish = None
        else:
            pending, finish = all_gather_quantized(policy.primary, shard, full, kind,
                                                   policy.weight_bits, policy.block)
        keep = self.phase == "forward" and policy.secondary is not None
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
