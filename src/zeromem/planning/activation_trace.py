"""Activation memory traced from one forward of the real model (ZeRO section 3.2, ZeRO-R 6.1).

No formula: the model's own forward runs once on fake tensors (`FakeTensorMode`:
shapes, dtypes and storages, no data, no memory) under `saved_tensors_hooks`, and
every tensor autograd saves for backward is counted once per storage (a tensor saved
by three ops, or two views of one buffer, are one allocation). Parameters and
buffers are left out: they are model states. What is counted is exactly what a real
forward on the same device holds between forward and backward, whatever the
architecture (MLP width, gating, which attention kernel stores scores).

Checkpointing is read off the same trace. Forward hooks on the repeated blocks
(Hugging Face's `GradientCheckpointingLayer`s, else the longest `nn.ModuleList`)
split the saved storages into those of each block and those outside any block, and
record each block's tensor inputs, which is what `zeromem.checkpoint` keeps. With
every block checkpointed, backward peaks either at its start (the stored inputs plus
everything saved outside the blocks) or while it recomputes a block (the inputs not
yet consumed, what was saved outside before that block, and that block's own saved
tensors). Pa divides the stored floating-point inputs over the model-parallel group;
Pa+cpu moves them to host memory, and a recomputing block then gets its input back
on the device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from zeromem.planning.shape_memory import ActivationMemory

_TOKEN_NAMES = ("input_ids", "tokens", "idx", "ids", "input", "inputs", "x")
_TARGET_NAMES = ("labels", "targets", "target", "y")


@dataclass(frozen=True)
class ActivationProfile:
    """Saved bytes of one micro-batch's forward, split by block (see the module docstring)."""

    saved_bytes: int  # no checkpointing: everything autograd saves, once per storage
    outside_bytes: tuple[int, ...]  # [k]: saved outside any block after k blocks had started
    checkpoint_bytes: tuple[int, ...]  # [i]: tensor inputs of block i (new storages only)
    checkpoint_float_bytes: tuple[int, ...]  # [i]: the floating-point part, which Pa splits
    block_bytes: tuple[int, ...]  # [i]: what block i saves itself, its inputs excluded
    input_saved_bytes: tuple[int, ...]  # [i]: inputs of block i that block i also saves
    blocks: str = ""  # where the blocks were found, for the plan's text

    def memory(self, checkpointing: str = "none", mp: int = 1,
               partition: bool = False) -> ActivationMemory:
        """Device (and host) bytes at the backward peak: `checkpointing` "none" | "gpu" | "cpu"."""
        if checkpointing == "none" or not self.block_bytes:
            per_layer = max(self.block_bytes, default=0)
            return ActivationMemory(float(self.saved_bytes), 0.0, float(per_layer), 0.0)
        split = mp if partition and mp > 1 else 1
        stored = [c - f + f / split for c, f in zip(self.checkpoint_bytes,
                                                     self.checkpoint_float_bytes)]
        on_host = checkpointing == "cpu"
        kept = [0.0 if on_host else s for s in stored]
        copied_back = on_host or split > 1  # recompute gets a fresh device copy of its input
        peak = sum(self.outside_bytes) + sum(kept)
        for i in range(len(self.block_bytes)):
            restored = self.input_saved_bytes[i] if copied_back else 0
            peak = max(peak, sum(self.outside_bytes[:i + 1]) + sum(kept[:i + 1])
                       + self.block_bytes[i] + restored)
        return ActivationMemory(float(peak), float(sum(stored)) if on_host else 0.0,
                                float(max(self.block_bytes)), float(sum(stored)))


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """(description, blocks): Hugging Face's checkpointing layers, else the longest ModuleList."""
    layer_class: type[nn.Module] | None
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer as layer_class
    except ImportError:
        layer_class = None  # older transformers, or none
    if layer_class is not None:
        layers: list[tuple[str, nn.Module]] = [(n, m) for n, m in model.named_modules()
                                               if isinstance(m, layer_class)]
        if layers:
            return f"{len(layers)} Hugging Face layers ({type(layers[0][1]).__name__})", \
                [m for _, m in layers]
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return "", []
    name, longest = max(lists, key=lambda item: len(item[1]))
    return f"{name or 'model'} ({len(longest)} blocks)", list(longest)


@dataclass
class _Tracer:
    """Counts storages as hooks report them: saved tensors and block inputs."""

    excluded: set[int]
    blocks: list[nn.Module]
    current: int | None = None
    started: int = 0
    seen: set[object] = field(default_factory=set)  # storages, and (tag, block, storage) keys
    outside: list[int] = field(default_factory=list)
    block_saved: list[int] = field(default_factory=list)
    block_inputs: list[set[int]] = field(default_factory=list)
    ckpt: list[int] = field(default_factory=list)
    ckpt_float: list[int] = field(default_factory=list)
    input_saved: list[int] = field(default_factory=list)
    total: int = 0

    def __post_init__(self) -> None:
        n = len(self.blocks)
        self.outside = [0] * (n + 1)
        self.block_saved, self.ckpt, self.ckpt_float, self.input_saved = ([0] * n for _ in range(4))
        self.block_inputs = [set() for _ in range(n)]

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.excluded:
            return tensor
        i = self.current
        if i is not None and key in self.block_inputs[i]:
            if ("in", i, key) not in self.seen:  # alive anyway as the stored checkpoint
                self.seen.add(("in", i, key))
                self.input_saved[i] += storage.nbytes()
            if key not in self.seen:
                self.seen.add(key)
                self.total += storage.nbytes()
            return tensor
        if i is not None and ("block", i, key) not in self.seen:
            # per block: a tensor shared by all blocks (rotary tables) is saved again by each
            # block's recompute
            self.seen.add(("block", i, key))
            self.block_saved[i] += storage.nbytes()
        if key in self.seen:
            return tensor
        self.seen.add(key)
        self.total += storage.nbytes()
        if i is None:
            self.outside[self.started] += storage.nbytes()
        return tensor

    def enter(self, index: int, args: tuple, kwargs: dict) -> None:
        self.current, self.started = index, max(self.started, index + 1)
        for t in [*args, *kwargs.values()]:
            if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
                continue
            storage = t.untyped_storage()
            self.block_inputs[index].add(storage._cdata)
            if ("ckpt", storage._cdata) in self.seen or storage._cdata in self.seen:
                continue
            self.seen.add(("ckpt", storage._cdata))
            self.ckpt[index] += t.numel() * t.element_size()
            if t.is_floating_point():
                self.ckpt_float[index] += t.numel() * t.element_size()

    def leave(self) -> None:
        self.current = None


def example_inputs(model: nn.Module, micro_batch: int, seq: int, vocab: int) -> tuple[tuple, dict]:
    """(args, kwargs) of a language model's training forward: token ids and targets.

    The forward's parameter names decide: `input_ids` + `labels` (Hugging Face), else the
    first parameter gets tokens and a `targets`-like second one the same shape again. A
    Hugging Face vision model (`pixel_values`) gets images of its config's size and class
    labels instead.
    """
    names = list(inspect.signature(model.forward).parameters)
    if "pixel_values" in names:
        return (), _images(getattr(model, "config", None), micro_batch, "labels" in names)
    tokens = torch.randint(0, max(vocab, 2), (micro_batch, seq))
    targets = torch.randint(0, max(vocab, 2), (micro_batch, seq))
    if "input_ids" in names:
        return (), {"input_ids": tokens, **({"labels": targets} if "labels" in names else {})}
    target = next((n for n in names[1:] if n in _TARGET_NAMES), None)
    return ((tokens, targets) if target == names[1] else (tokens,)), {}


def training_loss(output: object) -> torch.Tensor:
    """The loss of a training forward given `example_inputs`: the output itself, or its
    `.loss` (a Hugging Face model given labels)."""
    loss = getattr(output, "loss", output)
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ValueError("MODEL's forward must return its loss: a scalar tensor, or an "
                         "output with `.loss` (a Hugging Face model given labels)")
    return loss


def _images(config: object, micro_batch: int, labelled: bool) -> dict:
    """Random images as the config sizes them (`image_size`, `num_channels`), and a class of
    `num_labels` for each."""
    size = getattr(config, "image_size", 224)
    height, width = (size, size) if isinstance(size, int) else size
    images = torch.randn(micro_batch, getattr(config, "num_channels", 3), height, width)
    labels = torch.randint(0, max(getattr(config, "num_labels", 2), 2), (micro_batch,))
    return {"pixel_values": images, **({"labels": labels} if labelled else {})}


def trace_activations(model: nn.Module, micro_batch: int, seq: int, dtype: torch.dtype,
                      vocab: int) -> ActivationProfile:
    """Trace one training forward of `model` (meta or real; never allocated) at `dtype`.

    A Hugging Face model runs differently with checkpointing on (no KV cache in
    training, for one), so its checkpointed figures come from a second trace with its
    checkpointing switched on and a checkpoint function that just calls the block.
    """
    args, kwargs = example_inputs(model, micro_batch, seq, vocab)
    plain = _trace(model, args, kwargs, dtype)
    flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    if not flagged:
        return plain
    saved = [(m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
             for m in flagged]
    try:
        for m in flagged:
            setattr(m, "gradient_checkpointing", True)
            setattr(m, "_gradient_checkpointing_func", _call)
        checkpointed = _trace(model, args, kwargs, dtype)
    finally:
        for m, (flag, func) in zip(flagged, saved):
            m.gradient_checkpointing = flag
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func
    return dataclasses.replace(checkpointed, saved_bytes=plain.saved_bytes)


@contextlib.contextmanager
def _real_run_masks():
    """Hugging Face builds an explicit attention mask when it sees fake tensors (it takes
    them for torch.compile), where the real run on an unpadded batch passes `is_causal`
    and stores no mask. During the trace its two skip checks are asked as for that real
    run: no padding mask and no cache offset, and no packed sequences (our example batch
    has none of them)."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa",
             "find_packed_sequence_indices")
    real = {name: getattr(masking_utils, name, None) for name in names}
    if None in real.values():  # another transformers: trace as it is
        yield
        return
    causal, bidirectional = real["_ignore_causal_mask_sdpa"], real["_ignore_bidirectional_mask_sdpa"]
    masking_utils._ignore_causal_mask_sdpa = (
        lambda padding_mask, q_length, kv_length, q_offset, kv_offset, *rest:
        causal(None, q_length, kv_length, 0, kv_offset, *rest))
    masking_utils._ignore_bidirectional_mask_sdpa = (
        lambda padding_mask, kv_length, *rest: bidirectional(None, kv_length, *rest))
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        for name, function in real.items():
            setattr(masking_utils, name, function)


def _call(function, *args):
    return function(*args)


@contextlib.contextmanager
def _quiet_meta_failures() -> Iterator[None]:
    """FakeTensorMode logs a traceback for each op its meta kernel refuses, then raises it: to
    the model, which may take another path, or out of the trace, which the planner reports in
    one line before it falls back to the formula (an fp32 plan of a transformers mixture of
    experts: `torch._grouped_mm`'s meta kernel takes bf16 only). The forty lines said no more."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    before, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = before


def _trace(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> ActivationProfile:
    description, blocks = find_blocks(model)
    with _quiet_meta_failures(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        args, kwargs = (tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args),
                        {k: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                         for k, t in kwargs.items()})
        params = {n: torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype,
                                 device="cpu").requires_grad_(p.requires_grad)
                  for n, p in model.named_parameters()}
        buffers = {n: torch.zeros(b.shape, dtype=b.dtype, device="cpu")
                   for n, b in model.named_buffers()}
        tracer = _Tracer({t.untyped_storage()._cdata for t in (*params.values(),
                                                              *buffers.values())}, blocks)
        handles = [h for i, b in enumerate(blocks) for h in (
            b.register_forward_pre_hook(lambda m, a, k, i=i: tracer.enter(i, a, k),
                                        with_kwargs=True),
            b.register_forward_hook(lambda m, a, o: tracer.leave()))]
        was_training = model.training
        try:
            model.train()
            with _real_run_masks(), \
                    torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t):
                functional_call(model, {**params, **buffers}, tuple(args), kwargs)
        finally:
            model.train(was_training)
            for h in handles:
                h.remove()
    return ActivationProfile(tracer.total, tuple(tracer.outside), tuple(tracer.ckpt),
                             tuple(tracer.ckpt_float), tuple(tracer.block_saved),
                             tuple(tracer.input_saved), description)
