"""Building models already partitioned (`Init`) and reading them whole (`GatheredParameters`).

`Init` (ZeRO paper section 5.3; DeepSpeed's `zero.Init`): while the context is
open, each submodule is partitioned as soon as it is attached to its parent, i.e.
right after its own constructor (and weight initialisation) finished. Each rank
keeps 1/N_d of every parameter, so building a model needs about one submodule's
full parameters plus 1/N_d of the model. Values are those of an ordinary build
under the same seed: partitioning happens after initialisation. No constructor
is patched: torch's global module-registration hooks tell us when a child is
attached, and parameter-registration hooks list the parameters built inside.

Partitioned parameters, and the stage-3 fetch units of running engines, are
found through one weak registry keyed by parameter (`_SHARDS`, `_UNITS`): the
DeepSpeed-compatible `GatheredParameters(params)` receives bare parameters, and
we keep no attributes on `nn.Parameter`.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from .comm import Comm
from .distributed import ensure_process_group


@dataclass
class ParamShard:
    """This rank's 1/N_d of one parameter built under `Init` (flattened, padded)."""

    shard: torch.Tensor
    shape: torch.Size
    numel: int


class _WeakById:
    """A weak map keyed by tensor identity (WeakKeyDictionary would compare tensors by value)."""

    def __init__(self) -> None:
        self.items: dict[int, tuple[weakref.ref, object]] = {}

    def __setitem__(self, key: torch.Tensor, value: object) -> None:
        self.items[id(key)] = (weakref.ref(key, lambda _, k=id(key): self.items.pop(k, None)), value)

    def __getitem__(self, key: torch.Tensor):
        return self.items[id(key)][1]

    def __contains__(self, key: torch.Tensor) -> bool:
        entry = self.items.get(id(key))
        return entry is not None and entry[0]() is key

    def __delitem__(self, key: torch.Tensor) -> None:
        del self.items[id(key)]


_SHARDS = _WeakById()  # parameter -> ParamShard, for parameters built under Init
_UNITS = _WeakById()   # parameter -> stage3.FetchUnit of a live engine


def register_units(units: Iterable) -> None:
    """Let `GatheredParameters` find the fetch unit of each stage-3 parameter."""
    for unit in units:
        for p in unit.group.params:
            _UNITS[p] = unit


def _partition(p: nn.Parameter, comm: Comm) -> None:
    if p in _SHARDS or p.numel() == 0:
        return
    n = comm.world_size
    size = max(1, math.ceil(p.numel() / n))
    flat = torch.zeros(size * n, dtype=p.dtype, device=p.device)
    flat[:p.numel()].copy_(p.detach().reshape(-1))
    _SHARDS[p] = ParamShard(flat[comm.rank * size:(comm.rank + 1) * size].clone(), p.shape,
                            p.numel())
    p.data = p.data.new_empty(0)


def _gather_whole(p: nn.Parameter, comm: Comm) -> torch.Tensor:
    entry = _SHARDS[p]
    whole = torch.empty(entry.shard.numel() * comm.world_size, dtype=entry.shard.dtype,
                        device=entry.shard.device)
    comm.all_gather(whole, entry.shard)
    return whole[:entry.numel].view(entry.shape).to(p.dtype)


def _reshard(p: nn.Parameter, comm: Comm) -> None:
    """Copy this rank's part of whole `p` back into its shard; `p` becomes empty again."""
    entry = _SHARDS[p]
    size = entry.shard.numel()
    flat = torch.zeros(size * comm.world_size, dtype=p.dtype, device=p.device)
    flat[:entry.numel].copy_(p.detach().reshape(-1))
    entry.shard.copy_(flat[comm.rank * size:(comm.rank + 1) * size])
    p.data = p.data.new_empty(0)


def materialize(params: Iterable[nn.Parameter], comm: Comm) -> None:
    """Give parameters built under `Init` their whole values again (collective)."""
    for p in params:
        if p in _SHARDS:
            p.data = _gather_whole(p, comm)
            del _SHARDS[p]


def materialize_meta(module: nn.Module, device: torch.device) -> None:
    """Give a model built on the meta device real storage, module by module.

    Each module with meta tensors gets `to_empty` on `device` and its own
    `reset_parameters()`, in module order, so standard layers get the values an
    ordinary build would under the same seed (custom init schemes are not replayed).
    The whole model exists once before sharding; to bound memory while building,
    use `zeromem.Init` instead.
    """
    for m in module.modules():
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if any(t.is_meta for t in own):
            m.to_empty(device=device, recurse=False)
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


def partitioned_bytes(module: nn.Module) -> int:
    """Bytes this rank holds for `module`'s parameters (shards and whole ones)."""
    return sum(_SHARDS[p].shard.nbytes if p in _SHARDS else p.nbytes for p in module.parameters())


class Init:
    """Context in which modules are built with their parameters already partitioned.

        with zeromem.Init(config=ds_config):
            model = GPT(cfg)          # each rank holds 1/N_d of every parameter
        engine = zeromem.initialize(model, ds_config)

    `config` is accepted for DeepSpeed compatibility (stage 3 is implied).
    """

    def __init__(self, config=None, dp_group=None, enabled: bool = True):
        ensure_process_group()
        self.comm = Comm(dp_group)
        self.enabled = enabled
        self.built: list[weakref.ref] = []
        self.handles = []
        self.mode = _WholeWhileTouched(self)
        self.busy = False  # partitioning now: the mode must let our own tensor ops through

    def __enter__(self) -> Init:
        if self.enabled:
            self.handles = [
                module_hooks.register_module_module_registration_hook(self._on_child),
                module_hooks.register_module_parameter_registration_hook(self._on_param)]
            self.mode.__enter__()
        return self

    def _on_child(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is not None:
            self.busy = True
            try:
                for p in child.parameters():
                    _partition(p, self.comm)
            finally:
                self.busy = False

    def _on_param(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            self.built.append(weakref.ref(param))

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self.mode.__exit__(None, None, None)
        for h in self.handles:
            h.remove()
        self.handles = []
        # parameters owned directly by the outermost module(s): no parent attached them
        for ref in self.built:
            p = ref()
            if p is not None:
                _partition(p, self.comm)


class _WholeWhileTouched(TorchFunctionMode):
    """Under `Init`: an op on an already-partitioned parameter sees it whole.

    A parent's constructor may re-initialise its children after attaching them
    (`self.apply(init_weights)`, as GPT-style models do). Such an op gathers the
    parameter, runs, and in-place results go back into this rank's shard; every
    rank runs the same constructor, so the gathers match and the RNG draws are
    those of an ordinary build.
    """

    def __init__(self, init: Init):
        super().__init__()
        self.init = init

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = [a for a in (*args, *kwargs.values())
                   if isinstance(a, nn.Parameter) and a in _SHARDS]
        if self.init.busy or not touched:
            return func(*args, **kwargs)
        comm = self.init.comm
        for p in touched:
            p.data = _gather_whole(p, comm)
        try:
            return func(*args, **kwargs)
        finally:
            for p in touched:
                _reshard(p, comm)


class GatheredParameters:
    """Context in which the given stage-3 (or `Init`) parameters are whole on every rank.

    Collective: every rank must enter it. With `modifier_rank`, that rank's in-place
    edits are broadcast on exit and re-partitioned (fp32 masters included), so
    custom initialisation or surgery on a partitioned model is possible:

        with zeromem.GatheredParameters(model.head.weight, modifier_rank=0):
            if rank == 0:
                model.head.weight.zero_()
    """

    def __init__(self, params, modifier_rank: int | None = None, dp_group=None,
                 enabled: bool = True):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.units = list({id(_UNITS[p]): _UNITS[p] for p in params if p in _UNITS}.values())
        self.loose = [p for p in params if p in _SHARDS]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.comm = self.units[0].comm if self.units else Comm(dp_group)

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for unit in self.units:
            unit.pin()
        for p in self.loose:
            p.data = _gather_whole(p, self.comm)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        src = self.modifier_rank
        for unit in self.units:
            if src is not None:
                self.comm.broadcast(unit.full, src)
                unit.adopt_whole()
            unit.unpin()
        for p in self.loose:
            if src is not None:
                self.comm.broadcast(p.data, src)
            _reshard(p, self.comm)
