"""The flat parameter group: the one abstraction that carries every ZeRO stage.

A `FlatParamGroup` holds parameters of one dtype and one optimizer param group,
flattened into one contiguous buffer padded to a multiple of the data-parallel
world size N_d. Rank r owns the contiguous shard [r*S, (r+1)*S) of it. A group is
also the unit of gradient reduction (a bucket of at most `reduce_bucket_size`
elements), so a bucket's reduce-scatter is N equal chunks and lands exactly on
the owners' shards.

What a stage changes is only which of the group's buffers are whole and which
are sharded (ZeRO paper, section 5):

    stage  params   grads                                 master + optimizer
    0      whole    whole, all-reduced                    whole
    1      whole    whole, reduce-scattered at boundary   shard
    2      whole    shard, reduce-scattered every micro   shard
    3      shard    shard, reduce-scattered every micro   shard

That choice is data (`Sharding`) and the gradient buffer is an object chosen once
(`grads.py`); nothing here branches on a stage number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from .comm import Comm, Pending


@dataclass(frozen=True)
class Sharding:
    """Which kinds of model state are partitioned over the data-parallel ranks."""

    optimizer: bool
    grads: bool
    params: bool

    @classmethod
    def for_stage(cls, stage: int) -> Sharding:
        return cls(optimizer=stage >= 1, grads=stage >= 2, params=stage >= 3)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its group's flat buffer."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


class FlatParamGroup:
    """Parameters of one optimizer param group flattened into one padded buffer.

    Owns: `flat_param` (compute dtype, whole; None at stage 3), `param_shard`, the master shard (fp32; an alias of
    the parameter shard when the compute dtype is already fp32), and a gradient
    buffer object that decides how gradients are held and reduced.

    `params` arrive in the user's dtype and are cast to `dtype` (the compute dtype)
    here, so that the master shard keeps the user's own fp32 values rather than
    their bf16/fp16 rounding (as FSDP2's mixed precision does).
    """

    def __init__(self, params: list[nn.Parameter], names: list[str], comm: Comm,
                 sharding: Sharding, param_group_index: int, dtype: torch.dtype | None = None):
        self.params = params
        self.comm = comm
        self.param_group_index = param_group_index
        self.slots: list[ParamSlot] = []
        offset = 0
        for p, name in zip(params, names):
            self.slots.append(ParamSlot(name, offset, p.numel(), p.shape))
            offset += p.numel()
        self.numel = offset
        world = comm.world_size
        self.padded_numel = max(1, math.ceil(offset / world)) * world
        # The optimizer's partition: one shard per rank, or the whole buffer at stage 0.
        self.shard_world = world if sharding.optimizer else 1
        self.shard_numel = self.padded_numel // self.shard_world
        self.shard_offset = comm.rank * self.shard_numel if sharding.optimizer else 0

        p0 = params[0]
        dtype = dtype or p0.dtype
        # Read before the parameters are rounded to the compute dtype (issue 10, item 7).
        master = self._own_fp32_values(params) if dtype != torch.float32 else None
        self.flat_param = torch.zeros(self.padded_numel, dtype=dtype, device=p0.device)
        for p, slot in zip(params, self.slots):
            view = self.flat_param[slot.offset:slot.offset + slot.numel].view(slot.shape)
            view.copy_(p.detach())
            p.data = view  # the module now computes with views into the flat buffer
        self.param_shard = self.flat_param[self.shard_offset:self.shard_offset + self.shard_numel]
        if sharding.params:
            # Stage 3: only the shard persists; stage3.FetchUnit gathers the whole on demand.
            # The parameters let go of the whole buffer now, so that memory matches the
            # units' SHARDED state from `initialize` on (issue 10, item 3).
            self.param_shard = self.param_shard.clone()
            self.flat_param = None
            empty = self.param_shard.new_empty(0)
            for p in params:
                p.data = empty
        self.master = self.param_shard if master is None else master  # fp32: no second copy
        self.grads = None  # set by grads.attach(); see grads.py

    def _own_fp32_values(self, params: list[nn.Parameter]) -> torch.Tensor:
        """This rank's master shard from the parameters' own values, in fp32 (padding zero)."""
        master = torch.zeros(self.shard_numel, dtype=torch.float32, device=params[0].device)
        for p, slot in zip(params, self.slots):
            start, at, n = self.owned_slice(slot)
            if n:
                master[start:start + n].copy_(p.detach().reshape(-1)[at:at + n])
        return master

    # -- after the optimizer step -----------------------------------------
    def master_aliases_params(self) -> bool:
        return self.master.data_ptr() == self.param_shard.data_ptr()

    def write_back(self) -> None:
        """Copy the updated master shard into this rank's parameter shard."""
        if not self.master_aliases_params():
            self.param_shard.copy_(self.master)

    def launch_all_gather(self, bucket_numel: int) -> Iterator[Pending]:
        """All-gather the updated shards into `flat_param`, at most `bucket_numel` per collective.

        A generator: each chunk's buffer is allocated only when the caller asks for
        the next collective, so the caller bounds how many are in flight (CB).
        """
        if self.shard_world == 1 or self.flat_param is None:
            return  # nothing to gather: stage 0, or stage 3 (gathered when used)
        n, shard = self.shard_world, self.shard_numel
        if self.padded_numel <= bucket_numel:
            # In place: this rank's shard already sits at its slot of the output (NCCL and gloo allow it).
            yield self.comm.all_gather(self.flat_param, self.param_shard, async_op=True)
            return
        # Chunk the shard so no single collective exceeds the bucket (constant buffers).
        chunk = max(1, bucket_numel // n)
        full = self.flat_param.view(n, shard)
        for start in range(0, shard, chunk):
            end = min(start + chunk, shard)
            out = torch.empty(n, end - start, dtype=full.dtype, device=full.device)
            self.comm.note_buffer(out)

            def scatter_back(out=out, start=start, end=end) -> None:
                full[:, start:end].copy_(out)
                self.comm.release_buffer(out)

            pending = self.comm.all_gather(out.view(-1), self.param_shard[start:end], async_op=True)
            yield Pending(pending.work, scatter_back, forget=pending.forget)

    # -- views ------------------------------------------------------------
    def owned_slice(self, slot: ParamSlot) -> tuple[int, int, int]:
        """(start in the shard, start in the parameter, length) of `slot`'s owned part."""
        lo = max(slot.offset, self.shard_offset)
        hi = min(slot.offset + slot.numel, self.shard_offset + self.shard_numel)
        if hi <= lo:
            return (0, 0, 0)
        return (lo - self.shard_offset, lo - slot.offset, hi - lo)
