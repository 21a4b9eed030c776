"""Activation checkpointing with ZeRO-R's activation optimizations (ZeRO paper, sections 3.2 and 6).

`checkpoint(function, *args, **kwargs)` runs `function` without building a graph and
keeps only its tensor inputs (the "checkpoint"); backward recomputes the segment
and backpropagates through it. On top of that, the configured policy decides how a
checkpoint is stored:

- Pa (`partition_activations`): a floating-point input is flattened, padded and split
  across the model-parallel group, where every rank holds the same copy; each rank
  keeps 1/N_mp and the pieces are all-gathered before recompute. Without a
  model-parallel group it does nothing (and says so once).
- Pa+cpu (`cpu_checkpointing`): the stored tensors (the partitions when Pa is on) live
  in host memory: pinned and copied on a side CUDA stream when the input is on a GPU.
- MD (`contiguous_memory_optimization`): stored tensors are copied into one
  pre-allocated pool of `number_checkpoints` x (bytes of the first checkpoint), used
  as a stack (forward pushes, backward pops), so it never grows and never fragments.

Recompute design (reentrant). The segment is one `torch.autograd.Function`. Its
backward restores the inputs as fresh leaves, recomputes under the forward's RNG and
autocast state, and calls `torch.autograd.backward` once on the recomputed outputs.
That single call reaches both the restored inputs and the parameters: the input
grads are returned to the outer graph and the parameter grads accumulate into
`.grad` as usual, so each parameter's post-accumulate-grad hook fires once per
segment per backward. We chose this over the saved-tensor-hooks (non-reentrant)
style because the forward runs under `no_grad`: no graph, no saved-tensor holders,
no dropout masks exist between forward and backward, only the stored inputs, which
is what Pa / Pa+cpu / MD then shrink or move. Costs of the choice, as in torch's
reentrant mode: `torch.autograd.grad` cannot reach parameters inside a segment, a
segment can be backpropagated once (no `retain_graph`), and a parameter used in
several segments (or also outside them) accumulates once per use.

All mutable state lives in one `ActivationCheckpointing` object (policy, stores,
byte ledger). The engine owns one, built from its config (`for_engine`), and makes
it the active one while its forward and backward run (`active()`, a context
variable, so nothing process-wide is mutated). The module-level functions act on
the active instance, and outside any engine on the default instance that
DeepSpeed's `checkpointing.configure` sets: that edge is the only place a default
lives.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zeromem.comm import Comm

logger = logging.getLogger("zeromem")

DEVICE = "device"
HOST = "host"
_ONCE = ("checkpoint inputs were already consumed: a checkpointed segment can be "
         "backpropagated once (retain_graph is not supported)")
_ALIGN_BYTES = 64  # pool slots start on 64-byte boundaries, so a view of any dtype is aligned


@dataclass(frozen=True)
class CheckpointingConfig:
    """How checkpoints are stored; field names follow DeepSpeed's `activation_checkpointing`."""

    mp_group: Any = None
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
class CheckpointStats:
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


class CheckpointLedger:
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

    def snapshot(self) -> CheckpointStats:
        return CheckpointStats(dict(self.held), dict(self.peak), dict(self.pool), self.live_tensors)


@dataclass
class _Slot:
    start: int
    end: int
    freed: bool = False


class ContiguousCheckpointPool:
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
class _StoredTensor:
    """One tensor argument of one checkpointed call, as stored between forward and backward."""

    payload: torch.Tensor
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool
    place: str
    nbytes: int
    ledger: CheckpointLedger
    version: int | None = None  # set when `payload` aliases the caller's tensor
    slot: _Slot | None = None
    pool: ContiguousCheckpointPool | None = None
    copied: Any = None  # CUDA event recorded after an asynchronous copy to host
    released: bool = False

    def release(self) -> None:
        """Return the bytes (and pool slot); idempotent."""
        if self.released:
            return
        self.released = True
        self.ledger.remove(self.place, self.nbytes)
        if self.slot is not None:
            self.pool.free(self.slot)
        self.payload = None

    def __del__(self) -> None:
        # A graph dropped without backward must still give its bytes and slots back.
        self.release()


class ActivationStore:
    """Stores checkpoint inputs as the policy says (Pa, Pa+cpu, MD) and restores them."""

    def __init__(self, config: CheckpointingConfig, ledger: CheckpointLedger) -> None:
        self.config = config
        self.ledger = ledger
        self.mp_size = config.mp_size
        self.comm = Comm(config.mp_group) if self.mp_size > 1 else None
        self.mp_rank = self.comm.rank if self.comm is not None else 0
        self.pool = (ContiguousCheckpointPool(config.number_checkpoints)
                     if config.contiguous_memory_optimization else None)
        self._side_stream = None  # created on the first asynchronous host copy

    def place(self) -> str:
        return HOST if self.config.cpu_checkpointing else DEVICE

    def _partitions(self, t: torch.Tensor) -> bool:
        # Parameters are held by the model anyway; integer/bool tensors (ids, masks) are small.
        return (self.config.partition_activations and self.mp_size > 1
                and t.is_floating_point() and not isinstance(t, nn.Parameter))

    def _stored_numel(self, t: torch.Tensor) -> int:
        return math.ceil(t.numel() / self.mp_size) if self._partitions(t) else t.numel()

    def stash(self, tensors: list[torch.Tensor]) -> list[_StoredTensor]:
        """Store the tensor inputs of one checkpointed call."""
        if self.pool is not None and tensors:
            nbytes = sum(_aligned(self._stored_numel(t) * t.element_size()) for t in tensors)
            host = self.config.cpu_checkpointing
            self.pool.reserve(nbytes, torch.device("cpu") if host else tensors[0].device,
                              pin_memory=host and _on_gpu(tensors[0]))
            self.ledger.pool[self.place()] = self.pool.pool_bytes
        return [self._stash_one(t) for t in tensors]

    def _stash_one(self, t: torch.Tensor) -> _StoredTensor:
        src = t.detach()
        partitioned = self._partitions(t)
        to_host = self.config.cpu_checkpointing and src.device.type != "cpu"
        if partitioned:
            numel = self._stored_numel(t)
            start = min(self.mp_rank * numel, src.numel())
            src = src.reshape(-1)[start:start + numel]
        stored = _StoredTensor(src, t.shape, t.device, t.requires_grad, partitioned,
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
        self._side_stream.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(self._side_stream):
            dest[:flat.numel()].copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side_stream)
        flat.record_stream(self._side_stream)
        return event

    def restore(self, stored: _StoredTensor) -> torch.Tensor:
        """The input as a fresh leaf on its original device (gathered when partitioned)."""
        if stored.released:
            raise RuntimeError(_ONCE)
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
        full = shard.new_empty(shard.numel() * self.mp_size)
        self.comm.all_gather(full, shard.contiguous())
        return full


def _synchronize_device() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _autocast_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class _Segment:
    """One checkpointed call: its function, argument layout, stored inputs and RNG state."""

    def __init__(self, function: Callable, args: tuple, kwargs: dict, store: ActivationStore,
                 preserve_rng_state: bool) -> None:
        self.function = function
        self.store = store
        self.preserve_rng_state = preserve_rng_state
        # Tensor arguments travel through autograd; the templates keep the rest with None
        # where a tensor was, so this object never holds the caller's tensors itself.
        self.args = list(args)
        self.kwargs = dict(kwargs)
        self.slots = ([("arg", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
                      + [("kwarg", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)])
        self.stored: list[_StoredTensor] = []
        self.cpu_rng: torch.Tensor | None = None
        self.cuda_rng: torch.Tensor | None = None
        self.cuda_device: int | None = None
        self.autocast: list[tuple[str, bool, torch.dtype]] = []

    def take_tensors(self) -> list[torch.Tensor]:
        """The tensor arguments, removed from the templates."""
        tensors = []
        for kind, key in self.slots:
            holder = self.args if kind == "arg" else self.kwargs
            tensors.append(holder[key])
            holder[key] = None
        return tensors

    def call(self, tensors: list[torch.Tensor]) -> Any:
        args, kwargs = list(self.args), dict(self.kwargs)
        for (kind, key), t in zip(self.slots, tensors):
            (args if kind == "arg" else kwargs)[key] = t
        return self.function(*args, **kwargs)

    def run_forward(self, tensors: list[torch.Tensor]) -> Any:
        self.capture_state()
        self.stored = self.store.stash(tensors)
        with torch.no_grad():
            return self.call(tensors)

    def capture_state(self) -> None:
        if self.preserve_rng_state:
            self.cpu_rng = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self.cuda_device = torch.cuda.current_device()
                self.cuda_rng = torch.cuda.get_rng_state(self.cuda_device)
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in _autocast_devices()]

    @contextlib.contextmanager
    def replayed_state(self):
        """RNG and autocast state of the forward, without disturbing the caller's RNG."""
        devices = [self.cuda_device] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, enabled=self.preserve_rng_state), \
                contextlib.ExitStack() as stack:
            if self.preserve_rng_state:
                torch.set_rng_state(self.cpu_rng)
                if self.cuda_rng is not None:
                    torch.cuda.set_rng_state(self.cuda_rng, self.cuda_device)
            for device, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, enabled=enabled, dtype=dtype))
            yield

    def backward(self, grad_outputs: tuple) -> tuple:
        """Recompute, backpropagate once, return the grads of the tensor inputs."""
        start = time.perf_counter()
        grads = self._recompute_and_backward(grad_outputs)
        if self.store.config.profile:
            _synchronize_device()
            logger.info("checkpoint %s: recompute+backward %.3f ms", _name(self.function),
                        1e3 * (time.perf_counter() - start))
        return grads

    def _recompute_and_backward(self, grad_outputs: tuple) -> tuple:
        try:
            inputs = [self.store.restore(s) for s in self.stored]
            with self.replayed_state(), torch.enable_grad():
                outputs = self.call(inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            if pairs:
                # One call reaches the restored inputs and the parameters together, so each
                # parameter's grad accumulates (and its hook fires) once for this segment.
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            return tuple(t.grad if t.requires_grad else None for t in inputs)
        finally:
            for s in self.stored:
                s.release()


class _CheckpointFunction(torch.autograd.Function):
    """Runs a `_Segment` without a graph; its backward recomputes it (see module docstring)."""

    @staticmethod
    def forward(ctx, segment: _Segment, anchor: torch.Tensor | None, *tensors: torch.Tensor):
        ctx.segment = segment
        ctx.set_materialize_grads(False)  # unused outputs arrive as None and are skipped
        outputs = segment.run_forward(list(tensors))
        if not isinstance(outputs, (torch.Tensor, tuple)):
            raise TypeError("a checkpointed function must return a tensor or a tuple, "
                            f"got {type(outputs).__name__}")
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        segment, ctx.segment = ctx.segment, None  # drop the segment (and its stored inputs) now
        if segment is None:
            raise RuntimeError(_ONCE)
        return (None, None) + segment.backward(grad_outputs)


class ActivationCheckpointing:
    """The one mutable object of this module: the policy, its store and the byte ledger."""

    def __init__(self, config: CheckpointingConfig | None = None) -> None:
        self.ledger = CheckpointLedger()
        self._said_pa_is_noop = False
        self.configure(config or CheckpointingConfig())

    def configure(self, config: CheckpointingConfig) -> None:
        """Adopt a new policy; checkpoints stored under the old one still restore."""
        self.config = config
        self.store = ActivationStore(config, self.ledger)
        self.ledger.pool = {DEVICE: 0, HOST: 0}  # the old pool goes with the old store
        if config.partition_activations and config.mp_size == 1 and not self._said_pa_is_noop:
            self._said_pa_is_noop = True
            logger.warning("activation_checkpointing.partition_activations does nothing without a "
                           "model-parallel group: data-parallel ranks hold different activations, "
                           "so there is no replicated copy to split (see DESIGN.md, note on Pa)")

    def checkpoint(self, function: Callable, *args: Any, preserve_rng_state: bool = True,
                   **kwargs: Any) -> Any:
        """Checkpoint `function(*args, **kwargs)` under this object's policy."""
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)  # nothing will backpropagate: keep nothing
        segment = _Segment(function, args, kwargs, self.store, preserve_rng_state)
        tensors = segment.take_tensors()
        # With no input needing grad, autograd would leave the segment out of the graph
        # and the parameters inside would get no grads; a tiny leaf keeps it in.
        needs_anchor = not any(t.requires_grad for t in tensors)
        anchor = torch.empty(0, requires_grad=True) if needs_anchor else None
        if self.config.synchronize_checkpoint_boundary:
            _synchronize_device()
        start = time.perf_counter()
        outputs = _CheckpointFunction.apply(segment, anchor, *tensors)
        if self.config.synchronize_checkpoint_boundary or self.config.profile:
            _synchronize_device()
        if self.config.profile:
            logger.info("checkpoint %s: forward %.3f ms", _name(function),
                        1e3 * (time.perf_counter() - start))
        return outputs

    def stats(self) -> CheckpointStats:
        return self.ledger.snapshot()

    def held_bytes(self, place: str | None = None) -> int:
        """Bytes held in stored checkpoints now: at `place` ("device" / "host"), or in total."""
        held = self.ledger.held
        return sum(held.values()) if place is None else held[place]

    def reset_peak(self) -> None:
        """Start a new peak measurement from the bytes held now."""
        self.ledger.reset_peak()

    @contextlib.contextmanager
    def active(self):
        """Make `checkpoint()` use this instance inside the block (the engine's forward and
        backward); the previous one is back afterwards, also after an error."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


def _name(function: Callable) -> str:
    return getattr(function, "__qualname__", type(function).__name__)


_DEFAULT = ActivationCheckpointing()  # DeepSpeed's `checkpointing.configure` edge only
_ACTIVE: contextvars.ContextVar[ActivationCheckpointing | None] = contextvars.ContextVar(
    "zeromem_activation_checkpointing", default=None)


def current() -> ActivationCheckpointing:
    """The instance `checkpoint` uses now: the running engine's, else the default."""
    return _ACTIVE.get() or _DEFAULT


def configure(mp_group: Any = None, partition_activations: bool = False,
              cpu_checkpointing: bool = False, contiguous_memory_optimization: bool = False,
              number_checkpoints: int | None = None, synchronize_checkpoint_boundary: bool = False,
              profile: bool = False) -> CheckpointingConfig:
    """Set the policy `checkpoint` uses (DeepSpeed's `checkpointing.configure`, minus globals)."""
    config = CheckpointingConfig(mp_group, partition_activations, cpu_checkpointing,
                                 contiguous_memory_optimization, number_checkpoints,
                                 synchronize_checkpoint_boundary, profile)
    _DEFAULT.configure(config)
    return config


_FIELDS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
           "number_checkpoints", "synchronize_checkpoint_boundary", "profile")


def config_from_block(block: Any, mp_group: Any = None) -> CheckpointingConfig:
    """The policy an `activation_checkpointing` config block (DeepSpeed's key names) gives."""
    defaults = CheckpointingConfig()
    values = {name: getattr(block, name, getattr(defaults, name)) for name in _FIELDS}
    return CheckpointingConfig(mp_group=mp_group, **values)


def configure_from_config(block: Any, mp_group: Any = None) -> CheckpointingConfig:
    """Set the default policy from an `activation_checkpointing` config block."""
    config = config_from_block(block, mp_group)
    _DEFAULT.configure(config)
    return config


def for_engine(block: Any) -> ActivationCheckpointing:
    """An engine's own instance, built from its `activation_checkpointing` block.

    A block that sets any key gives the whole policy, with the model-parallel group
    given to `configure` (a group is not JSON); a block that sets none keeps the
    policy `configure` set before `initialize`, as DeepSpeed's users expect. The
    default's policy is read once here, never changed.
    """
    edge = _DEFAULT.config
    if getattr(block, "model_fields_set", None):
        return ActivationCheckpointing(config_from_block(block, mp_group=edge.mp_group))
    return ActivationCheckpointing(edge)


def get_config() -> CheckpointingConfig:
    """The policy `checkpoint` uses now."""
    return current().config


def checkpoint(function: Callable, *args: Any, preserve_rng_state: bool = True,
               use_reentrant: bool | None = None, **kwargs: Any) -> Any:
    """Drop-in for `torch.utils.checkpoint.checkpoint` with Pa / Pa+cpu / MD.

    The forward runs under `no_grad` and keeps only the tensor arguments (stored as the
    configured policy says); backward restores them, replays the CPU (and current CUDA
    device's) RNG state and autocast state, recomputes and backpropagates. Positional
    and keyword arguments may mix tensors and other values; tensors nested inside
    containers are passed through but not stored (as in torch's reentrant mode). The
    function returns a tensor or a tuple. `use_reentrant` is accepted for
    compatibility and ignored: the recompute is always the single-backward design
    described in the module docstring.
    """
    del use_reentrant
    return current().checkpoint(function, *args, preserve_rng_state=preserve_rng_state,
                                **kwargs)


def checkpoint_stats() -> CheckpointStats:
    """Bytes held in stored checkpoints by place, their peaks and the MD pool sizes, of the
    active instance (outside an engine the default; an engine's own is
    `engine.activation_checkpointing`)."""
    return current().stats()


def held_checkpoint_bytes(place: str | None = None) -> int:
    """Bytes held in stored checkpoints of the active instance now, at `place` or in total."""
    return current().held_bytes(place)


def reset_peak_checkpoint_bytes() -> None:
    """Start a new peak measurement of the active instance from the bytes held now."""
    current().reset_peak()


def estimate_checkpoint_bytes(seq: int, hidden: int, batch: int = 1, bytes_per_element: int = 2,
                              mp_size: int = 1) -> int:
    """Bytes of one layer's checkpoint (its `batch x seq x hidden` input) per rank.

    With Pa each of the `mp_size` model-parallel ranks keeps ceil(numel / mp_size)
    elements: seq 2048, hidden 4096, 2-byte activations give 16 MiB, 2 MiB at N_mp = 8.
    """
    return math.ceil(seq * hidden * batch / mp_size) * bytes_per_element
