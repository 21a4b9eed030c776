"""Parameter placements: where the stage-3 parameter shards live (`offload_param`).

ZeRO-Offload (arXiv 2101.06840) and ZeRO-Infinity (arXiv 2104.07857, section 5)
move the fp16/bf16 parameter shard of each flat group off the device. One
placement is chosen from the `OffloadPolicy` by `offload.build_offload`, before
the stage-3 fetch units are built, and passed to them; the fetch units and the
optimizer go through it and never branch on an offload flag (STYLE rule 3).
The three classes share no base class; each implements `ParamPlacement`:

    ParamsOnDevice (none) | ParamsOnHost (cpu) | ParamsOnNvme (nvme, stage 3)
        admit(group)             take a group's shard over, as the engine builds the group
        fetch(group, reader)     `ShardedUnit.unshard`: the shard in memory before its gather
        release(group)           the shard's memory given back (written out first if changed)
        prefetch(group)          start bringing a shard in early
        follow(order)            the runner's recorded unit order for the pass now running
        load / store(group, start, ...)   the optimizer reads / writes shard pieces
        read_piece / write_piece(...)        the same for the NVMe optimizer's fp32 masters,
                                 through its own aligned buffer (no parameter buffer held)
        flush()                  step phase 5: stored values reach the shard's place
        all_in_memory()          every shard in memory inside the block (checkpoints)

A placement is built before the flat groups, from the shard sizes alone, and takes
each group's shard over as soon as the engine has built it (`admit`): the host and
NVMe ones copy the shard to its place and empty `group.param_shard` at once. So
under `zeromem.Init` no rank ever holds every parameter shard in memory: the NVMe
file is laid out before the groups exist and each shard is written as it is made
(ZeRO-Infinity's "infinity offload engine" at initialisation). A master that
aliases the shard (fp32) is read back through `load` by the masters placement.

Buffer lifetimes:

- ParamsOnDevice: `group.param_shard` is the shard, in device memory for the
  engine's life.
- ParamsOnHost: one (pinned) host tensor per group holds the shard for the
  engine's life; when the device is the CPU it is `group.param_shard` itself.
  Otherwise `group.param_shard` is emptied at construction and `fetch` gives
  it a device copy; at most `offload_param.buffer_count` copies are alive, the
  least recently used one dropped (after the all-gather reading it finishes).
  `store` writes the host tensor and the device copy, if one is alive.
- ParamsOnNvme: see offload/params_nvme.py.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Protocol, Sequence

import torch

from zeromem.config.schema import OffloadParamConfig
from zeromem.flat import FlatParamGroup
from zeromem.offload.nvme import IOHandle, piece_view

__all__ = ["ParamPlacement", "ParamsOnDevice", "ParamsOnHost", "host_empty"]


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor, pinned if `pin` (for non-blocking copies to the device)."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


class Reader(Protocol):
    """What reads a shard while it is in memory: a stage-3 `ShardedUnit` and its all-gather."""

    pending: Any  # the all-gather in flight, or None

    def wait(self) -> None:
        """Finish the all-gather (after which the shard may leave memory)."""


class ParamPlacement(Protocol):
    """Where the parameter shards live; the verbs every parameter placement offers."""

    where: str  # "device" | "host" | "nvme"
    copies: int  # 2: `write_piece` writes a second copy, the shards once `commit`ted

    def admit(self, group: FlatParamGroup) -> None:
        """Take over `group.param_shard` (the groups arrive in the order of the sizes given)."""

    def fetch(self, group: FlatParamGroup, reader: Reader | None = None) -> None:
        """Make `group.param_shard` usable; `reader`'s all-gather will read it."""

    def release(self, group: FlatParamGroup) -> None:
        """Give `group.param_shard`'s memory back (written to its place first if changed)."""

    def prefetch(self, group: FlatParamGroup) -> None:
        """Start bringing `group.param_shard` in."""

    def follow(self, order: Sequence[Any] | None) -> None:
        """The fetch units in the order the pass now running recorded (None: not recorded)."""

    def prefetch_numel(self, configured: int, set_in_config: bool) -> int:
        """Elements the stage-3 schedule may gather ahead (stage3_prefetch_bucket_size)."""

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        """Copy shard elements [start, start + out.numel()) into `out`."""

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        """Write `values` (any dtype) into the shard at `start`, in the shard's dtype."""

    def read_piece(self, group: FlatParamGroup, start: int, numel: int, buf: torch.Tensor,
                   after: Sequence[IOHandle] = ()) -> IOHandle | None:
        """Start bringing fp32 shard elements [start, start + numel) to `piece_view(start, numel,
        buf)` (`buf`: aligned uint8, `piece_bytes(numel)` long); None when already there."""

    def write_piece(self, group: FlatParamGroup, start: int, numel: int,
                    buf: torch.Tensor) -> list[IOHandle]:
        """Store the piece at `piece_view(start, numel, buf, the shard's dtype)` as those shard
        elements (pieces of a shard in any order within a step); the writes `buf` must
        outlive."""

    def commit(self) -> None:
        """The step is taken: with two copies, the pieces written are the shards now."""

    def discard(self) -> None:
        """The step is skipped: with two copies, the pieces written are forgotten."""

    def flush(self) -> None:
        """Make stored values durable in the shard's place."""

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        """Every parameter shard in memory inside the block."""

    def file_into(self, ledger) -> None:
        """File this placement's tensors and bytes in the memory ledger."""

    def pool_bytes(self) -> int:
        """Host bytes of its staging pool, taken from the NVMe host budget (offload/budget.py)."""

    def close(self) -> None:
        """Release storage."""


def _load_piece(placement: ParamPlacement, group: FlatParamGroup, start: int, numel: int,
                buf: torch.Tensor, after: Sequence[IOHandle] = ()) -> IOHandle | None:
    """`read_piece` of a placement in memory: its `load` into the piece's place in `buf`,
    once the writes `after` (still reading from `buf`) have finished."""
    for h in after:
        h.wait()
    placement.load(group, start, piece_view(start, numel, buf))
    return None


def _store_piece(placement: ParamPlacement, group: FlatParamGroup, start: int, numel: int,
                 buf: torch.Tensor) -> list[IOHandle]:
    """`write_piece` of a placement in memory: its `store`, done when it returns."""
    placement.store(group, start, piece_view(start, numel, buf, group.param_shard.dtype))
    return []


class ParamsOnDevice:
    """Parameter shards stay in device memory (no `offload_param`)."""

    where = "device"
    copies = 1

    def admit(self, group: FlatParamGroup) -> None:
        """Nothing to do: the shard stays in device memory."""

    def fetch(self, group: FlatParamGroup, reader: Reader | None = None) -> None:
        """Nothing to do: the shard is in device memory."""

    def release(self, group: FlatParamGroup) -> None:
        """Nothing to do: the shard stays."""

    def prefetch(self, group: FlatParamGroup) -> None:
        """Nothing to do: the shard is in device memory."""

    def follow(self, order: Sequence[Any] | None) -> None:
        """Nothing is read ahead."""

    def prefetch_numel(self, configured: int, set_in_config: bool) -> int:
        return configured

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        out.copy_(group.param_shard[start:start + out.numel()])

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        group.param_shard[start:start + values.numel()].copy_(values)

    read_piece = _load_piece  # in memory: a piece is a load / store through the buffer
    write_piece = _store_piece

    def commit(self) -> None:
        """One copy: the pieces went straight into the shard."""

    def discard(self) -> None:
        """One copy: nothing to forget."""

    def flush(self) -> None:
        """Stores went straight into the shard."""

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def file_into(self, ledger) -> None:
        """The engine files the device shards itself."""

    def pool_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """No storage of its own."""


class ParamsOnHost:
    """`offload_param.device: cpu`: shards in (pinned) host memory, copied to the device on use."""

    where = "host"
    copies = 1

    def __init__(self, config: OffloadParamConfig, pin: bool, device: torch.device):
        self.groups: list[FlatParamGroup] = []
        self.limit = config.buffer_count
        self.pin = pin
        self.in_memory: OrderedDict[int, FlatParamGroup] = OrderedDict()  # device copies, LRU
        self.host: dict[int, torch.Tensor] = {}
        self.readers: dict[int, Reader] = {}
        self.copies = device.type != "cpu"  # else host is the device: shards already in place

    def admit(self, group: FlatParamGroup) -> None:
        """The host tensor becomes the truth (the device's shard is dropped)."""
        self.groups.append(group)
        shard = group.param_shard
        self.host[id(group)] = host_empty(group.shard_numel, shard.dtype, self.pin).copy_(
            shard) if self.copies else shard
        if self.copies:
            group.drop_shard_storage()

    def fetch(self, group: FlatParamGroup, reader: Reader | None = None) -> None:
        """A device copy of the shard (dropping the least recently used one beyond the limit)."""
        if not self.copies:
            return
        key = id(group)
        if reader is not None:
            self.readers[key] = reader
        if key in self.in_memory:
            self.in_memory.move_to_end(key)
            return
        while len(self.in_memory) >= self.limit:
            old = self.in_memory.popitem(last=False)[1]
            reader_of_old = self.readers.get(id(old))
            if reader_of_old is not None and reader_of_old.pending is not None:
                reader_of_old.wait()  # its all-gather still reads the shard
            old.drop_shard_storage()
        device = group.param_shard.device
        group.set_shard_storage(self.host[key].to(device, non_blocking=True))
        self.in_memory[key] = group

    def release(self, group: FlatParamGroup) -> None:
        """Drop the device copy (the host tensor always holds the values)."""
        if self.copies and self.in_memory.pop(id(group), None) is not None:
            group.drop_shard_storage()

    def prefetch(self, group: FlatParamGroup) -> None:
        """Copies are made on `fetch` only."""

    def follow(self, order: Sequence[Any] | None) -> None:
        """Nothing is read ahead."""

    def prefetch_numel(self, configured: int, set_in_config: bool) -> int:
        return configured

    def load(self, group: FlatParamGroup, start: int, out: torch.Tensor) -> None:
        out.copy_(self.host[id(group)][start:start + out.numel()])

    def store(self, group: FlatParamGroup, start: int, values: torch.Tensor) -> None:
        self.host[id(group)][start:start + values.numel()].copy_(values)
        if self.copies and id(group) in self.in_memory:
            group.param_shard[start:start + values.numel()].copy_(values)

    read_piece = _load_piece  # in memory: a piece is a load / store through the buffer
    write_piece = _store_piece

    def commit(self) -> None:
        """One copy: the pieces went straight into the host tensors."""

    def discard(self) -> None:
        """One copy: nothing to forget."""

    def flush(self) -> None:
        """Stores went straight into the host tensors."""

    def all_in_memory(self) -> contextlib.AbstractContextManager:
        """The host tensors are in memory already."""
        return contextlib.nullcontext()

    def file_into(self, ledger) -> None:
        for t in self.host.values():
            ledger.add("params", "host", t)

    def pool_bytes(self) -> int:
        return 0  # the shards themselves live in host memory, outside any staging budget

    def close(self) -> None:
        """Host tensors are freed with the placement."""
