"""How a stage-3 fetch unit is all-gathered: flat, from hpZ's secondary copy, or quantized.

`ParamGather` is shared by all fetch units of an engine; the schedule tells it which
pass runs (`start_pass`) and when the optimizer stepped (`new_step`).

- Plain: the unit's shard is all-gathered over the primary group (every shard rank).
- qwZ (ZeRO++ section 3.1): each rank packs its shard as block-wise int8 plus fp32
  scales (quantize.py); the packed shards are all-gathered and dequantized into the
  whole buffer, about half the bytes of bf16.
- hpZ (section 3.2): after a training forward's gather, the rank keeps slice
  `position` of the whole buffer, where `position` is its rank in the secondary
  group (a block of h consecutive ranks, normally the node). The block's slices
  together are the whole buffer, so the backward gather runs over the block only and
  never leaves the node. The copies live from the forward to the optimizer step
  (`new_step` drops them: the step changes the parameters). Being cut from the
  gathered (with qwZ: dequantized) buffer, they give backward the forward's weights.

Ledger kinds: `all_gather_forward`, `all_gather_eval` (no_grad forwards),
`all_gather_backward`.
"""
from __future__ import annotations

import torch

from zeromem import quantize
from zeromem.comm import Comm, Pending


class ParamGather:
    """Launches stage-3 all-gathers; owns hpZ's secondary shards."""

    def __init__(self, primary: Comm, secondary: Comm | None = None,
                 weight_bits: int | None = None, block: int = 256):
        self.primary = primary
        self.secondary = secondary  # hpZ's group; None: off
        self.weight_bits = weight_bits  # qwZ: 8; None: off
        self.block = block
        self.phase = "forward"
        self.secondary_shards: dict[int, torch.Tensor] = {}  # id(group) -> slice of the whole

    def start_pass(self, phase: str) -> None:
        """"forward", "eval" or "backward": backward gathers from the secondary copies."""
        self.phase = phase

    def new_step(self) -> None:
        """The optimizer changed the parameters: the secondary copies are stale."""
        self.secondary_shards.clear()
        self.phase = "forward"

    def held(self) -> list[torch.Tensor]:
        return list(self.secondary_shards.values())

    def launch(self, group, full: torch.Tensor) -> Pending:
        """Start gathering `group`'s whole buffer into `full` (async)."""
        kind = f"all_gather_{self.phase}"
        secondary = self.secondary_shards.get(id(group))
        if self.phase == "backward" and secondary is not None:
            assert self.secondary is not None  # copies exist only with hpZ on
            return self.secondary.all_gather(full, secondary, async_op=True, kind=kind)
        if self.weight_bits is None:
            pending = self.primary.all_gather(full, group.param_shard, async_op=True, kind=kind)
            finish = None
        else:
            pending, finish = self._quantized(group.param_shard, full, kind, self.weight_bits)
        keep = self.phase == "forward" and self.secondary is not None
        inner = pending.finish  # Comm's own finishing step (the comms_logger's record)

        def done() -> None:
            if inner is not None:
                inner()
            if finish is not None:
                finish()
            if keep:
                self._keep_secondary(group, full)

        return Pending(pending.work, done, pending.explain, pending.forget)

    def _quantized(self, shard: torch.Tensor, full: torch.Tensor, kind: str, bits: int):
        """qwZ: all-gather the packed int8 shards; `finish` dequantizes them into `full`."""
        n, numel = self.primary.world_size, shard.numel()
        packed = quantize.pack(shard.view(1, -1), bits, self.block).view(-1)
        out = torch.empty(n * packed.numel(), dtype=torch.uint8, device=shard.device)
        pending = self.primary.all_gather(out, packed, async_op=True, kind=kind)

        def finish() -> None:
            rows = quantize.unpack(out.view(n, -1), numel, bits, self.block, full.dtype)
            full.view(n, numel).copy_(rows)

        return pending, finish

    def _keep_secondary(self, group, full: torch.Tensor) -> None:
        assert self.secondary is not None
        size = full.numel() // self.secondary.world_size  # padded_numel is a multiple of N
        start = self.secondary.rank * size
        self.secondary_shards[id(group)] = full[start:start + size].clone()
