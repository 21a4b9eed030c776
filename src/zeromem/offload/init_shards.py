"""`zeromem.Init`'s parameter shards in a swap file (ZeRO-Infinity, arXiv 2104.07857, section 5).

ZeRO-Infinity builds models too large for host memory by partitioning each
parameter as it is made and moving its partition straight to its place (section
5's "memory-centric tiling" aside, DeepSpeed's `zero.Init(remote_device="nvme")`).
Kept in host memory, the shards `Init` makes are 1/N_d of the model: 4 bytes per
element in fp32, a quarter of the model states, and they grow with the model. With
`offload_param.device: nvme` in the config given to `Init`, each shard goes to the
file init.swp under `offload_param.nvme_path` as soon as it is made, so building a
model holds one submodule whole and nothing that grows with the model.

    ShardFile
        put(shard) -> ShardRecord     append (the file grows as shards arrive)
    ShardRecord
        read() / write(values)        the shard, in a fresh buffer / written in place

Buffer lifetimes: a shard is in memory only while it is written or read (the
buffer `read` returns lives as long as its caller keeps it). Records are never
freed one by one: the file lives as long as a record refers to it (each holds
the `ShardFile`), i.e. until `initialize` has given every parameter its whole
value again; then the swap directory is removed (`SwapSpace`'s finaliser).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from zeromem.config.schema import AioConfig
from zeromem.offload.nvme import AsyncIO, SwapSpace, aligned_empty, round_up

GROW_BYTES = 64 << 20  # the file grows by at least this much (fewer fallocate calls)


class ShardFile:
    """An append-only swap file of parameter shards (one ALIGN-aligned record each)."""

    def __init__(self, nvme_path: str | os.PathLike, rank: int, aio: AioConfig):
        self.space = SwapSpace(nvme_path, rank, AsyncIO.from_config(aio))
        self.file = self.space.file("init.swp", GROW_BYTES)
        self.end = 0  # bytes used

    def put(self, shard: torch.Tensor) -> ShardRecord:
        """Write `shard` (any device) to a new record and return where it is."""
        nbytes = round_up(max(1, shard.nbytes))
        if self.end + nbytes > self.file.nbytes:
            self.file.grow(max(self.end + nbytes, self.file.nbytes + GROW_BYTES))
        record = ShardRecord(self, self.end, shard.numel(), shard.dtype, shard.device)
        self.end += nbytes
        record.write(shard)
        return record


@dataclass(frozen=True)
class ShardRecord:
    """One shard in a `ShardFile`: `numel` elements of `dtype`, used on `device`."""

    owner: ShardFile  # keeps the file (and its directory) alive while the record is
    offset: int
    numel: int
    dtype: torch.dtype
    device: torch.device

    held_nbytes = 0  # in memory: nothing

    def _buffer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(an aligned uint8 buffer of the whole record, its first `numel` elements)."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        raw = aligned_empty(round_up(max(1, self.numel * itemsize)))
        return raw, raw[:self.numel * itemsize].view(self.dtype)

    def read(self) -> torch.Tensor:
        """The shard's values, in a new tensor on `device`."""
        raw, values = self._buffer()
        self.owner.file.read(raw, self.offset).wait()
        return values.to(self.device)

    def write(self, values: torch.Tensor) -> None:
        """Store `values` (`numel` elements) as the shard."""
        raw, staged = self._buffer()
        staged.copy_(values.detach().reshape(-1))
        self.owner.file.write(raw, self.offset).wait()
