"""Where activation checkpoints are kept (ZeRO paper, section 6): the policy, the stores, the ledger.

A checkpoint's stored inputs are partitioned across the model-parallel group (Pa),
kept in host memory (Pa+cpu) and/or copied into one pre-allocated pool used as a
stack (MD); `ActivationStore` stores and restores them, `ActivationLedger` counts
their bytes by place. The recompute itself is `activations/recompute.py`.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeromem.comm import Comm

logger = logging.getLogger("zeromem")

DEVICE = "device"
HOST = "host"
ALREADY_CONSUMED = ("checkpoint inputs were already consumed: a checkpointed segment can be "
         "backpropagated once (retain_graph is not supported)")
_ALIGN_BYTES = 64  # pool slots start on 64-byte boundaries, so a view of any dtype is aligned


@dataclass(frozen=True)
class ActivationPolicy:
    """How activation checkpoints are stored; field names follow DeepSpeed's `activation_checkpointing`."""

    mp_group: dist.ProcessGroup | None = None
    """Model-parallel process group Pa splits checkpoints across; None: no model parallelism."""
    partition_activations: bool = False
    """Pa: keep 1/N_mp of each floating-point checkpoint input, all-gather before recompute."""
    cpu_checkpointing: bool = False
    """Pa+cpu: keep the stored checkpoints (their partitions with Pa) in host memory."""
    contiguous_memory_optimization: bool = False
    """MD: copy stored checkpoints into one pre-allocated contiguous pool."""
    number_checkpoints: int | None = None
    """Checkpointed calls per forward pass; sizes the MD pool (required with MD)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the CUDA device at the start and end of each checkpointed forward."""
    profile: bool = False
    """Log the forward and recompute+backward time of each checkpointed call."""

    def __post_init__(self) -> None:
        if self.contiguous_memory_optimization:
            if self.number_checkpoints is None or self.number_checkpoints < 1:
                raise ValueError("activation_checkpointing.contiguous_memory_optimization needs "
                                 "activation_checkpointing.number_checkpoints >= 1 to size its "
                                 f"pool, got {self.number_checkpoints!r}")

    @property
    def mp_size(self) -> int:
        """Size of the model-parallel group (1 without one)."""
        return 1 if self.mp_group is None else dist.get_world_size(self.mp_group)


@dataclass(frozen=True)
class ActivationStats:
    """Bytes held in stored checkpoints by place ("device" / "host"), now and at peak."""

    held_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    pool_bytes: dict[str, int]
    live_tensors: int

    @property
    def total_held_bytes(self) -> int:
        return sum(self.held_bytes.values())

    @property
    def total_pool_bytes(self) -> int:
        return sum(self.pool_bytes.values())


class ActivationLedger:
    """Counts the bytes of stored checkpoints as they are stashed and released."""

    def __init__(self) -> None:
        self.held = {DEVICE: 0, HOST: 0}
        self.peak = {DEVICE: 0, HOST: 0}
        self.pool = {DEVICE: 0, HOST: 0}
        self.live_tensors = 0

    def add(self, place: str, nbytes: int) -> None:
        self.held[place] += nbytes
        self.peak[place] = max(self.peak[place], self.held[place])
        self.live_tensors += 1

    def remove(self, place: str, nbytes: int) -> None:
        self.held[place] -= nbytes
        self.live_tensors -= 1

    def reset_peak(self) -> None:
        self.peak = dict(self.held)

    def snapshot(self) -> ActivationStats:
        return ActivationStats(dict(self.held), dict(self.peak), dict(self.pool), self.live_tensors)


@dataclass
class _Slot:
    start: int
    end: int
    freed: bool = False


class ContiguousActivationPool:
    """MD: one byte buffer that holds the stored checkpoints of a forward pass.

    Allocated on the first checkpoint as `number_checkpoints` x that checkpoint's
    bytes, then reused for every step. Slots are handed out like a stack: forward
    pushes, backward releases in reverse order, so once a backward has consumed
    everything the pool is empty again and the next forward starts at offset 0.
    """

    def __init__(self, number_checkpoints: int) -> None:
        self.number_checkpoints = number_checkpoints
        self.buffer: torch.Tensor | None = None
        self.checkpoint_bytes = 0
        self._slots: list[_Slot] = []

    @property
    def pool_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    @property
    def used_bytes(self) -> int:
        return self._slots[-1].end if self._slots else 0

    def reserve(self, checkpoint_bytes: int, device: torch.device, pin_memory: bool) -> None:
        """Allocate the buffer once, sized from the first checkpoint's bytes."""
        if self.buffer is not None:
            return
        self.checkpoint_bytes = checkpoint_bytes
        self.buffer = torch.empty(self.number_checkpoints * checkpoint_bytes, dtype=torch.uint8,
                                  device=device, pin_memory=pin_memory)

    def allocate(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, _Slot]:
        """A view of `numel` elements of `dtype` at the top of the pool."""
        assert self.buffer is not None, "reserve() runs before the first allocate()"
        nbytes = numel * dtype.itemsize
        start = self.used_bytes
        if start + _aligned(nbytes) > self.pool_bytes:
            raise RuntimeError(
                f"contiguous checkpoint pool is full: a checkpoint needs {nbytes} bytes but "
                f"{self.pool_bytes - start} of {self.pool_bytes} are free. The pool was sized for "
                "activation_checkpointing.number_checkpoints="
                f"{self.number_checkpoints} checkpoints of {self.checkpoint_bytes} bytes "
                f"(the first checkpoint's size); set it to the "
                "number of checkpointed calls per forward pass (and run backward before the next "
                "forward).")
        slot = _Slot(start, start + _aligned(nbytes))
        self._slots.append(slot)
        return self.buffer[start:start + nbytes].view(dtype), slot

    def free(self, slot: _Slot) -> None:
        """Release a slot; the stack shrinks past every freed slot at its top."""
        slot.freed = True
        while self._slots and self._slots[-1].freed:
            self._slots.pop()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


@dataclass(eq=False)
class StoredTensor:
    """One tensor argument of one checkpointed call, as stored between forward and backward."""

    payload: torch.Tensor
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool
    place: str
    nbytes: int
    ledger: ActivationLedger
    version: int | None = None  # set when `payload` aliases the caller's tensor
    slot: _Slot | None = None
    pool: ContiguousActivationPool | None = None
    copied: Any = None  # CUDA event recorded after an asynchronous copy to host
    released: bool = False

    def release(self) -> None:
        """Return the bytes (and pool slot); idempotent."""
        if self.released:
            return
        self.released = True
        self.ledger.remove(self.place, self.nbytes)
        if self.slot is not None and self.pool is not None:
            self.pool.free(self.slot)
        self.payload = torch.empty(0)  # drop the bytes; a released tensor is never restored

    def __del__(self) -> None:
        # A graph dropped without backward must still give its bytes and slots back.
        self.release()


class ActivationStore:
    """Stores checkpoint inputs as the policy says (Pa, Pa+cpu, MD) and restores them."""

    def __init__(self, config: ActivationPolicy, ledger: ActivationLedger) -> None:
        self.config = config
        self.ledger = ledger
        self.mp_size = config.mp_size
        self.comm = Comm(config.mp_group) if self.mp_size > 1 else None
        self.mp_rank = self.comm.rank if self.comm is not None else 0
        self.pool = (ContiguousActivationPool(config.number_checkpoints or 0)
                     if config.contiguous_memory_optimization else None)
        self._side_stream: torch.cuda.Stream | None = None  # made at the first async host copy

    def place(self) -> str:
        return HOST if self.config.cpu_checkpointing else DEVICE

    def _partitions(self, t: torch.Tensor) -> bool:
        # Parameters are held by the model anyway; integer/bool tensors (ids, masks) are small.
        return (self.config.partition_activations and self.mp_size > 1
                and t.is_floating_point() and not isinstance(t, nn.Parameter))

    def _stored_numel(self, t: torch.Tensor) -> int:
        return math.ceil(t.numel() / self.mp_size) if self._partitions(t) else t.numel()

    def stash(self, tensors: list[torch.Tensor]) -> list[StoredTensor]:
        """Store the tensor inputs of one checkpointed call."""
        if self.pool is not None and tensors:
            nbytes = sum(_aligned(self._stored_numel(t) * t.element_size()) for t in tensors)
            host = self.config.cpu_checkpointing
            self.pool.reserve(nbytes, torch.device("cpu") if host else tensors[0].device,
                              pin_memory=host and _on_gpu(tensors[0]))
            self.ledger.pool[self.place()] = self.pool.pool_bytes
        return [self._stash_one(t) for t in tensors]

    def _stash_one(self, t: torch.Tensor) -> StoredTensor:
        src = t.detach()
        partitioned = self._partitions(t)
        to_host = self.config.cpu_checkpointing and src.device.type != "cpu"
        if partitioned:
            numel = self._stored_numel(t)
            start = min(self.mp_rank * numel, src.numel())
            src = src.reshape(-1)[start:start + numel]
        stored = StoredTensor(src, t.shape, t.device, t.requires_grad, partitioned,
                               self.place(), 0, self.ledger)
        if partitioned or to_host or self.pool is not None:
            numel = self._stored_numel(t)
            stored.payload, stored.slot = self._destination(numel, src)
            stored.pool = self.pool
            stored.copied = self._copy_into(stored.payload, src.reshape(-1))
        else:
            stored.version = src._version  # we hold the caller's tensor: detect in-place edits
        stored.nbytes = stored.payload.numel() * stored.payload.element_size()
        self.ledger.add(stored.place, stored.nbytes)
        return stored

    def _destination(self, numel: int, src: torch.Tensor) -> tuple[torch.Tensor, _Slot | None]:
        if self.pool is not None:
            return self.pool.allocate(numel, src.dtype)
        if self.config.cpu_checkpointing:
            return torch.empty(numel, dtype=src.dtype, pin_memory=_on_gpu(src)), None
        return src.new_empty(numel), None

    def _copy_into(self, dest: torch.Tensor, flat: torch.Tensor):
        """Copy `flat` to the front of `dest`, zero the padding; returns a CUDA event or None."""
        dest[flat.numel():].zero_()
        if not (_on_gpu(flat) and dest.device.type == "cpu"):
            dest[:flat.numel()].copy_(flat)
            return None
        # Device -> pinned host on a side stream so the copy overlaps the forward. The side
        # stream waits for the producer; record_stream keeps the allocator from reusing the
        # source before the copy has read it.
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=flat.device)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(side):
            dest[:flat.numel()].copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        flat.record_stream(side)
        return event

    def restore(self, stored: StoredTensor) -> torch.Tensor:
        """The input as a fresh leaf on its original device (gathered when partitioned)."""
        if stored.released:
            raise RuntimeError(ALREADY_CONSUMED)
        payload = stored.payload
        if stored.version is not None and payload._version != stored.version:
            raise RuntimeError("an input of a checkpointed function was modified in place after "
                               "the forward pass; the recompute would see different values")
        if stored.copied is not None:
            torch.cuda.current_stream(stored.device).wait_event(stored.copied)
        if payload.device != stored.device:
            payload = payload.to(stored.device, non_blocking=True)
        if stored.partitioned:
            payload = self._gather(payload)
        if payload.shape != stored.shape:  # flat (copied, padded or gathered): cut and reshape
            payload = payload.reshape(-1)[:math.prod(stored.shape)].view(stored.shape)
        return payload.detach().requires_grad_(stored.requires_grad)

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        assert self.comm is not None  # only partitioned inputs are gathered, and only when mp > 1
        full = shard.new_empty(shard.numel() * self.mp_size)
        self.comm.all_gather(full, shard.contiguous())
        return full
