"""Activation checkpointing with ZeRO-R's activation optimizations (ZeRO paper, sections 3.2 and 6).

`checkpoint(function, *args, **kwargs)` runs `function` without building a graph and
keeps only its tensor inputs (the "checkpoint"); backward recomputes the segment
and backpropagates through it. On top of that, the configured policy decides how a
checkpoint is stored (by `activations/store.py`):

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
from typing import Any, Callable

import torch
import torch.distributed as dist

from zeromem.activations.store import (ALREADY_CONSUMED, DEVICE, HOST, ActivationLedger,
                                       ActivationPolicy, ActivationStats, ActivationStore,
                                       StoredTensor)

logger = logging.getLogger("zeromem")

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
        self.stored: list[StoredTensor] = []
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
            raise RuntimeError(ALREADY_CONSUMED)
        return (None, None) + segment.backward(grad_outputs)


class ActivationCheckpointing:
    """The one mutable object of this module: the policy, its store and the byte ledger."""

    def __init__(self, config: ActivationPolicy | None = None) -> None:
        self.ledger = ActivationLedger()
        self._said_pa_is_noop = False
        self.configure(config or ActivationPolicy())

    def configure(self, config: ActivationPolicy) -> None:
        """Adopt a new policy; checkpoints stored under the old one still restore."""
        self.config = config
        self.store = ActivationStore(config, self.ledger)
        self.ledger.pool = {DEVICE: 0, HOST: 0}  # the old pool goes with the old store
        if config.partition_activations and config.mp_size == 1 and not self._said_pa_is_noop:
            self._said_pa_is_noop = True
            logger.warning("activation_checkpointing.partition_activations does nothing without a "
                           "model-parallel group: data-parallel ranks hold different activations, "
                           "so there is no replicated copy to split (see DESIGN.md, note on Pa)")

    # Never traced, as DeepSpeed's checkpoint: compiled, the segment's forward let inductor
    # reuse its output's buffer, which the next segment had stored as its input.
    @torch._disable_dynamo
    def checkpoint(self, function: Callable, *args: Any, preserve_rng_state: bool = True,
                   **kwargs: Any) -> Any:
        """Checkpoint `function(*args, **kwargs)` under this object's policy; inside a
        `torch.compile`d module it runs eagerly (a graph break)."""
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

    def stats(self) -> ActivationStats:
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


def configure(mp_group: dist.ProcessGroup | None = None, partition_activations: bool = False,
              cpu_checkpointing: bool = False, contiguous_memory_optimization: bool = False,
              number_checkpoints: int | None = None, synchronize_checkpoint_boundary: bool = False,
              profile: bool = False) -> ActivationPolicy:
    """Set the policy `checkpoint` uses (DeepSpeed's `checkpointing.configure`, minus globals)."""
    config = ActivationPolicy(mp_group, partition_activations, cpu_checkpointing,
                              contiguous_memory_optimization, number_checkpoints,
                              synchronize_checkpoint_boundary, profile)
    _DEFAULT.configure(config)
    return config


_FIELDS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
           "number_checkpoints", "synchronize_checkpoint_boundary", "profile")


def config_from_block(block: object, mp_group: dist.ProcessGroup | None = None) -> ActivationPolicy:
    """The policy an `activation_checkpointing` config block (DeepSpeed's key names) gives."""
    defaults = ActivationPolicy()
    values = {name: getattr(block, name, getattr(defaults, name)) for name in _FIELDS}
    return ActivationPolicy(mp_group=mp_group, **values)


def configure_from_config(block: object, mp_group: dist.ProcessGroup | None = None) -> ActivationPolicy:
    """Set the default policy from an `activation_checkpointing` config block."""
    config = config_from_block(block, mp_group)
    _DEFAULT.configure(config)
    return config


def for_engine(block: object) -> ActivationCheckpointing:
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


def get_config() -> ActivationPolicy:
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


def checkpoint_stats() -> ActivationStats:
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
