"""fp32 masters written to disk as `initialize` builds each flat group (ZeRO-Infinity, section 5).

With the optimizer on NVMe and a 16-bit compute dtype, each flat group makes its fp32
master shard from the user's own values (flat.py): 4 bytes per element, a quarter of
the model states, which would all be in host memory at once before the optimizer
writes them to its file. That file cannot be laid out before the optimizer exists
(its records interleave the master with the optimizer states, whose number only the
built optimizer knows, and a client factory may build it), so each master goes to
masters.swp, one aligned record per group, the moment its group is built (`admit`),
and `SwappedOptimizer` copies them into its own records, one group read at a time
(`read`), after which this file is removed (`discard`).

Buffer lifetimes: a master is in memory from its group's construction to its
`admit` (one group), and again while the optimizer copies it (one group).
"""
from __future__ import annotations

from typing import Sequence

import torch

from zeromem.flat import FlatParamGroup
from zeromem.offload.nvme import SwapSpace, aligned_empty, round_up

FP32 = 4


class StagedMasters:
    """masters.swp: each flat group's fp32 master, written as the group is built."""

    def __init__(self, shard_numels: Sequence[int], space: SwapSpace):
        """Laid out for the shards of `shard_numels` elements, in `admit` order."""
        self.space = space
        self.planned = list(shard_numels)
        self.planned_offsets, total = [], 0
        for numel in self.planned:
            self.planned_offsets.append(total)
            total += round_up(numel * FP32)
        self.file = space.file("masters.swp", total)
        self.offsets: dict[int, int] = {}  # group id -> its record
        self.numel: dict[int, int] = {}

    def admit(self, group: FlatParamGroup) -> None:
        """Write the new group's master to its record; the master gives up its memory."""
        index = len(self.offsets)
        if index >= len(self.planned) or group.shard_numel != self.planned[index]:
            raise AssertionError(f"{self.file.path}: group {index} of {group.shard_numel} "
                                 "elements was not laid out")
        self.offsets[id(group)] = self.planned_offsets[index]
        self.numel[id(group)] = group.shard_numel
        raw, values = self._buffer(group.shard_numel)
        values.copy_(group.master)
        self.file.write(raw, self.offsets[id(group)]).wait()
        group.set_master_storage(torch.empty(0, device=group.master.device))

    def read(self, group: FlatParamGroup) -> torch.Tensor:
        """The group's master values, in a new (aligned) host tensor."""
        raw, values = self._buffer(self.numel[id(group)])
        self.file.read(raw, self.offsets[id(group)]).wait()
        return values

    def discard(self) -> None:
        """The optimizer holds the masters now: remove the file."""
        self.space.discard(self.file)

    @staticmethod
    def _buffer(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        raw = aligned_empty(round_up(max(1, numel) * FP32))
        return raw, raw[:numel * FP32].view(torch.float32)
