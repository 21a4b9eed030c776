"""Building models already partitioned (`Init`) and reading them whole (`GatheredParameters`).

`Init` (ZeRO paper section 5.3; DeepSpeed's `zero.Init`): while the context is
open, each submodule is partitioned as soon as it is attached to its parent, i.e.
right after its own constructor (and weight initialisation) finished. Each rank
keeps 1/N_d of every parameter, so building a model needs about one submodule's
full parameters plus 1/N_d of the model. Values are those of an ordinary build
on rank 0: partitioning happens after initialisation, and rank 0's values are
broadcast (as DDP and DeepSpeed do), so ranks need not be seeded alike. No constructor
is patched: torch's global module-registration hooks tell us when a child is
attached, and parameter-registration hooks list the parameters built inside.

Who holds a partitioned parameter is a `Partitions` table, passed to whoever needs
it: `Init` writes the shards it makes into one, the engine reads them (and files its
stage-3 fetch units there), `GatheredParameters` looks parameters up in it. The only
attributes kept on an `nn.Parameter` are DeepSpeed's names for what libraries read
(`ds_shape`, `ds_numel`, `ds_id`, `ds_status`: PEFT, RLHF savers); none is read here.
DeepSpeed's `GatheredParameters(params)` hands over bare parameters, so the public entry points (`Init()`,
`GatheredParameters()`, `zeromem.initialize`) fall back to one table, `DEFAULT`,
when given none: a default at the edge only, as `checkpointing.configure` keeps;
nothing beneath them reads it.
"""
from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from zeromem.comm import Comm
from zeromem.distributed import Runtime, ensure_process_group
from zeromem.config.schema import Config, ConfigError
from zeromem.ds_attributes import ZeroParamStatus, mark_partitioned
from zeromem.flat import FlatParamGroup
from zeromem.layout import ShardLayout
from zeromem.lockstep import Lockstep
from zeromem.offload.init_shards import ShardFile, ShardRecord


class KeptShard:
    """A shard in memory, on the device its parameter was built on (`ShardRecord`'s verbs)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.numel, self.dtype, self.device = tensor.numel(), tensor.dtype, tensor.device

    @property
    def held_nbytes(self) -> int:
        return self.tensor.nbytes

    def read(self) -> torch.Tensor:
        return self.tensor

    def write(self, values: torch.Tensor) -> None:
        self.tensor.copy_(values)


@dataclass
class ParamShard:
    """This rank's 1/N_d of one parameter built under `Init` (flattened, padded).

    Where it lives (`home`): in memory, or, when `Init`'s config puts parameters on
    NVMe, in a swap file (offload/init_shards.py), so that no rank holds 1/N_d of the
    model while building it."""

    home: KeptShard | ShardRecord
    shape: torch.Size
    numel: int

    def new_whole(self, world_size: int) -> torch.Tensor:
        """An uninitialised buffer of N_d shards (the padded whole), where the shard is used."""
        home = self.home
        return torch.empty(home.numel * world_size, dtype=home.dtype, device=home.device)


class _WeakById:
    """A weak map keyed by tensor identity (WeakKeyDictionary would compare tensors by value)."""

    def __init__(self) -> None:
        self.items: dict[int, tuple[weakref.ref, object]] = {}

    def __setitem__(self, key: torch.Tensor, value: object) -> None:
        k = id(key)
        self.items[k] = (weakref.ref(key, lambda _: self.items.pop(k, None)), value)

    def __getitem__(self, key: torch.Tensor):
        return self.items[id(key)][1]

    def __contains__(self, key: torch.Tensor) -> bool:
        entry = self.items.get(id(key))
        return entry is not None and entry[0]() is key

    def __delitem__(self, key: torch.Tensor) -> None:
        del self.items[id(key)]

    def get(self, key: torch.Tensor, default=None):
        return self[key] if key in self else default


class Partitions:
    """Who holds each partitioned parameter: the shard `Init` made, or a live engine's fetch unit.

    Entries are keyed weakly by parameter identity and live as long as the parameter.
    The shard verbs (`partition`, `gather_whole`, `reshard`, `materialize`) are the
    only writers of the shard entries; `add_units` is the engine's.
    """

    def __init__(self) -> None:
        self.shards = _WeakById()  # parameter -> ParamShard, for parameters built under Init
        self.whole = _WeakById()   # the ones `unshard` made whole, until `reshard`
        self.units = _WeakById()   # parameter -> stage3.ShardedUnit of a live engine
        self.wholes = _WeakById()  # parameter -> FlatParamGroup of a live stage 0-2 engine
        self.logs = _WeakById()    # parameter -> the Lockstep of the live engine holding it

    def add_units(self, units: Iterable, lockstep: Lockstep) -> None:
        """Let `GatheredParameters` find the fetch unit of each stage-3 parameter, and
        the engine's log its gathers are an event of."""
        for unit in units:
            for p in unit.group.params:
                self.units[p], self.logs[p] = unit, lockstep

    def add_groups(self, groups: Iterable[FlatParamGroup], lockstep: Lockstep) -> None:
        """Let `GatheredParameters(modifier_rank=...)` find the masters of stage 0-2 parameters."""
        for group in groups:
            for p in group.params:
                self.wholes[p], self.logs[p] = group, lockstep

    def refuse_taken(self, module: nn.Module) -> None:
        """A second engine on a model whose parameters a live stage-3 engine partitioned
        would find them empty: refused, naming one (DeepSpeed re-wraps such a model)."""
        for name, p in module.named_parameters():
            if p in self.units:
                raise RuntimeError(
                    f"initialize: parameter {name!r} is partitioned by a stage-3 engine built "
                    "on this model before; zeromem builds one engine per model: keep using "
                    "that engine (its forward, backward and step train the model)")

    def partition(self, p: nn.Parameter, comm: Comm, disk: ShardFile | None = None) -> None:
        """Keep this rank's part of rank 0's `p` (ranks need not be seeded alike, as in DDP),
        in memory, or written to `disk` at once."""
        if p in self.shards or p.numel() == 0:
            return
        layout = ShardLayout(p.numel(), comm.world_size, comm.rank)
        flat = torch.zeros(layout.padded_numel, dtype=p.dtype, device=p.device)
        flat[:p.numel()].copy_(p.detach().reshape(-1))
        comm.broadcast(flat, 0)
        start = layout.shard_offset
        mine = flat[start:start + layout.shard_numel]
        home = disk.put(mine) if disk is not None else KeptShard(mine.clone())
        self.shards[p] = ParamShard(home, p.shape, p.numel())
        # DeepSpeed's names, which libraries read on a partitioned parameter (PEFT sizes its
        # adapters from `ds_shape` when a model was built under Init; savers gather by `ds_id`)
        mark_partitioned(p, p.shape, p.numel(), layout.owned_slice(0, p.numel())[2])
        p.data = p.data.new_empty(0)
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]

    def unshard(self, p: nn.Parameter, comm: Comm) -> None:
        """Make `p` whole (collective) until `reshard`."""
        self.whole[p] = True  # first: under Init, the assignment below is an op on `p` too
        p.data = self.gather_whole(p, comm)
        p.ds_status = ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]

    def gather_whole(self, p: nn.Parameter, comm: Comm,
                     flat: torch.Tensor | None = None) -> torch.Tensor:
        """`p`'s whole value, all-gathered into `flat` (padded, N shards long) or a new buffer."""
        entry = self.shards[p]
        if flat is None:
            flat = entry.new_whole(comm.world_size)
        comm.all_gather(flat, entry.home.read())
        return flat[:entry.numel].view(entry.shape).to(p.dtype)

    def reshard(self, p: nn.Parameter, comm: Comm, src_rank: int | None = None) -> None:
        """Copy this rank's part of whole `p` (rank `src_rank`'s, if given) back into its shard.

        `p` becomes empty again.
        """
        entry = self.shards[p]
        layout = ShardLayout(entry.numel, comm.world_size, comm.rank)
        flat = torch.zeros(layout.padded_numel, dtype=p.dtype, device=p.device)
        flat[:entry.numel].copy_(p.detach().reshape(-1))
        if src_rank is not None:
            comm.broadcast(flat, src_rank)
        entry.home.write(flat[layout.shard_offset:layout.shard_offset + layout.shard_numel])
        p.data = p.data.new_empty(0)
        if p in self.whole:
            del self.whole[p]
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]

    def materialize(self, params: Iterable[nn.Parameter], comm: Comm) -> None:
        """Give parameters built under `Init` their whole values again (collective)."""
        for p in params:
            if p in self.shards:
                self.unshard(p, comm)
                del self.shards[p], self.whole[p]

    def full_numel(self, p: nn.Parameter) -> int:
        """Elements of `p` whole, also while `Init` holds only its shard."""
        entry = self.shards.get(p)
        return entry.numel if entry is not None else p.numel()

    def full_shape(self, p: nn.Parameter) -> torch.Size:
        """Shape of `p` whole, also while `Init` holds only its shard."""
        entry = self.shards.get(p)
        return entry.shape if entry is not None else p.shape

    def held_bytes(self, module: nn.Module) -> int:
        """Bytes this rank holds for `module`'s parameters (shards and whole ones)."""
        return sum(self.shards[p].home.held_nbytes if p in self.shards else p.nbytes
                   for p in module.parameters())


DEFAULT = Partitions()  # the public entry points' table when given none (module docstring)


class Init:
    """Context in which modules are built with their parameters already partitioned.

        with zeromem.Init(config=ds_config):
            model = GPT(cfg)          # each rank holds 1/N_d of every parameter
        engine = zeromem.initialize(model, ds_config)

    As DDP and DeepSpeed do, rank 0's values win: each parameter is broadcast from
    rank 0 as it is partitioned (and after any later in-place write), and buffers
    on exit, so ranks seeded differently build the same model.
    The shards go into `partitions` (`DEFAULT` if none is given), where the engine
    and `GatheredParameters` look for them. `config` (stage 3 is implied) says where
    they live: with `offload_param.device: nvme`, in a swap file under its
    `nvme_path` (offload/init_shards.py), each written as it is made, so building
    holds one submodule whole and no shard; otherwise in memory (as DeepSpeed's
    `remote_device`, which defaults to the config's `offload_param`).
    """

    def __init__(self, config=None, dp_group=None, enabled: bool = True,
                 partitions: Partitions | None = None):
        ensure_process_group()
        self.comm = Comm(dp_group)
        self.partitions = DEFAULT if partitions is None else partitions
        self.enabled = enabled
        self.disk = _shard_file(config, dp_group) if enabled else None
        self.built: list[weakref.ref] = []
        self.buffers: list[weakref.ref] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.mode = _WholeWhileTouched(self)
        self.busy = False  # partitioning now: the mode must let our own tensor ops through

    def __enter__(self) -> Init:
        if self.enabled:
            self.handles = [
                module_hooks.register_module_module_registration_hook(self._on_child),
                module_hooks.register_module_parameter_registration_hook(self._on_param),
                module_hooks.register_module_buffer_registration_hook(self._on_buffer)]
            self.mode.__enter__()
        return self

    def _on_child(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is not None:
            self.busy = True
            try:
                for p in child.parameters():
                    self.partitions.partition(p, self.comm, self.disk)
            finally:
                self.busy = False

    def _on_param(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            self.built.append(weakref.ref(param))

    def _on_buffer(self, module: nn.Module, name: str, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            self.buffers.append(weakref.ref(buffer))

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self.mode.__exit__(None, None, None)
        self.mode.forget_views()
        for h in self.handles:
            h.remove()
        self.handles = []
        # parameters owned directly by the outermost module(s): no parent attached them
        for ref in self.built:
            p = ref()
            if p is not None:
                self.partitions.partition(p, self.comm, self.disk)
        self.disk = None  # the shards' records keep their file as long as they need it
        # buffers are never partitioned, so their final values are broadcast once, here
        alive = {id(b): b for b in (ref() for ref in self.buffers) if b is not None}
        for b in alive.values():
            _broadcast_in_place(b, self.comm)


def _shard_file(config, group) -> ShardFile | None:
    """Init's swap file when `config` puts parameters on NVMe; else None (shards in memory)."""
    if config is None:
        return None
    cfg = placement_config(config)
    zero = cfg.zero_optimization
    if zero.offload_param_device != "nvme":
        return None
    block = zero.offload_param
    assert block is not None and block.nvme_path is not None  # validated with device nvme
    # named by the global rank, as the engine's swap files (read at this edge, as initialize does)
    return ShardFile(block.nvme_path, Runtime.from_env(group, None).global_rank, cfg.aio)


def placement_config(source: dict | str | os.PathLike | Config) -> Config:
    """The blocks of `source` that Init reads (`zero_optimization.offload_param`, `aio`).

    Hugging Face's `from_pretrained` hands Init the Trainer's DeepSpeed config before the
    Trainer fills its "auto" placeholders (scheduler steps, bucket sizes), so the other
    blocks cannot be validated yet; the engine validates them whole later.
    """
    raw, origin = Config.read(source)
    zero = raw.get("zero_optimization") or {}
    part: dict = {"zero_optimization": {"stage": 3}}
    if isinstance(zero, dict) and "offload_param" in zero:
        part["zero_optimization"]["offload_param"] = zero["offload_param"]
    if "aio" in raw:
        part["aio"] = raw["aio"]
    try:
        return Config.load(part)
    except ConfigError as error:
        raise ConfigError(f"{origin}: {error}" if origin else str(error)) from None


def _broadcast_in_place(tensor: torch.Tensor, comm: Comm) -> None:
    """Overwrite `tensor` with rank 0's (gloo has no bool; collectives need contiguity)."""
    if tensor.is_meta or tensor.numel() == 0 or comm.world_size == 1:
        return
    value = tensor.detach()
    staged = value.to(torch.uint8) if value.dtype == torch.bool else value.contiguous()
    comm.broadcast(staged, 0)
    if staged is not value:
        value.copy_(staged)


class _WholeWhileTouched(TorchFunctionMode):
    """Under `Init`: an op on an already-partitioned parameter sees it whole.

    A parent's constructor may re-initialise its children after attaching them
    (`self.apply(init_weights)`, as GPT-style and HF models do). Such an op gathers
    the parameter, runs, and rank 0's in-place results go back into each rank's shard.

    Writes may also go through a view: HF BERT runs `init.zeros_(weight[padding_idx])`,
    and T5-style code `weight.data.normal_()`. The view made by the first op aliases
    the gathered buffer, not the (now empty) parameter, so we remember which
    parameter and buffer each such view belongs to. An op on a view re-gathers the
    current shards into that same buffer, runs, and reshards the parameter from it.
    All live views of one parameter share one buffer, so they stay consistent.
    """

    def __init__(self, init: Init):
        super().__init__()
        self.init = init
        self.views = _WeakById()    # view -> (its parameter, the padded buffer it aliases)
        self.buffers = _WeakById()  # parameter -> weakref to the buffer its live views alias

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.init.busy:
            return func(*args, **kwargs)
        touched = self._touched(tree_leaves((args, kwargs)))
        if not touched:
            return func(*args, **kwargs)
        comm, partitions = self.init.comm, self.init.partitions
        for p, flat in touched:
            p.data = partitions.gather_whole(p, comm, flat)
        try:
            out = func(*args, **kwargs)
            self._remember_views(tree_leaves(out), touched)
            return out
        finally:
            for p, _ in touched:
                partitions.reshard(p, comm, src_rank=0)  # rank 0's writes, as its plain build would hold

    def forget_views(self) -> None:
        """Init is closed: later writes through old views are ordinary writes."""
        self.views = _WeakById()
        self.buffers = _WeakById()

    def _touched(self, leaves: list) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, buffer to gather it into) for each partitioned parameter an op reaches."""
        params = {}
        shards, whole = self.init.partitions.shards, self.init.partitions.whole
        for a in leaves:
            if isinstance(a, nn.Parameter) and a in whole:
                continue  # whole already (GatheredParameters): the op runs on it as it is
            if isinstance(a, nn.Parameter) and a in shards:
                params[id(a)] = a
            elif isinstance(a, torch.Tensor) and a in self.views:
                p = self.views[a][0]
                params[id(p)] = p
        return [(p, self._buffer_for(p)) for p in params.values()]

    def _buffer_for(self, p: nn.Parameter) -> torch.Tensor:
        """The buffer `p`'s live views alias, else a new one (padded: N shards long)."""
        ref = self.buffers.get(p)
        flat = ref() if ref is not None else None
        if flat is None:
            flat = self.init.partitions.shards[p].new_whole(self.init.comm.world_size)
        return flat

    def _remember_views(self, leaves: list, touched: list) -> None:
        by_storage = {flat.untyped_storage().data_ptr(): (p, flat) for p, flat in touched}
        for t in leaves:
            if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter) or t.is_meta:
                continue
            owner = by_storage.get(t.untyped_storage().data_ptr())
            if owner is not None:
                self.views[t] = owner  # holds the buffer exactly as long as the view lives
                self.buffers[owner[0]] = weakref.ref(owner[1])


class GatheredParameters:
    """Context in which the given stage-3 (or `Init`) parameters are whole on every rank.

    Collective: every rank must enter it. With `modifier_rank`, that rank's in-place
    edits are broadcast on exit and re-partitioned (fp32 masters included), so
    custom initialisation or surgery on a partitioned model is possible. A stage 0-2
    engine's parameters are whole already; with `modifier_rank` their edits reach the
    fp32 masters too, which a plain in-place edit of a bf16/fp16 parameter does not (the
    next step would write over it; DeepSpeed's context does nothing there):

        with zeromem.GatheredParameters(model.head.weight, modifier_rank=0):
            if rank == 0:
                model.head.weight.zero_()

    The parameters are looked up in `partitions` (`DEFAULT` if none is given): an
    engine's fetch units, or the shards `Init` made.
    """

    def __init__(self, params, modifier_rank: int | None = None, dp_group=None,
                 enabled: bool = True, partitions: Partitions | None = None):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.partitions = DEFAULT if partitions is None else partitions
        units = self.partitions.units
        self.units = list({id(units[p]): units[p] for p in params if p in units}.values())
        wholes = self.partitions.wholes
        self.wholes = list({id(wholes[p]): wholes[p] for p in params if p in wholes}.values())
        self.loose = [p for p in params if p in self.partitions.shards]
        logs = self.partitions.logs
        self.logs = list({id(logs[p]): logs[p] for p in params if p in logs}.values())
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.comm = self.units[0].comm if self.units else \
            self.wholes[0].comm if self.wholes else Comm(dp_group)

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        if self.modifier_rank is not None:
            for editable in [*self.units, *self.wholes]:
                editable.check_editable()
        if self.modifier_rank is not None or any(not u.persistent for u in self.units):
            for log in self.logs:  # it gathers, or broadcasts on exit: a collective call
                log.call("GatheredParameters")
        for unit in self.units:
            unit.pin()
        for p in self.loose:
            self.partitions.unshard(p, self.comm)
        return self

    def _warn_discarded_edits(self) -> None:
        """Edits made inside the block without `modifier_rank` are dropped on exit, as
        DeepSpeed drops them; said, since DeepSpeed says nothing (OpenRLHF's EMA at ZeRO-3
        never moved that way). Only the outermost block drops them; each rank tells of its
        own part."""
        edited = [u.name for u in self.units if u.pins == 1 and u.edited()]
        if edited:
            more = f" and {len(edited) - 4} more" if len(edited) > 4 else ""
            warnings.warn(
                f"rank {self.comm.rank}: parameters of {', '.join(map(repr, edited[:4]))}{more} changed "
                "inside GatheredParameters without modifier_rank: the change is dropped when "
                "the block ends (as in DeepSpeed). Pass modifier_rank=0 to keep rank 0's "
                "edit on every rank", stacklevel=3)

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        src = self.modifier_rank
        if src is None:
            self._warn_discarded_edits()
        for unit in self.units:
            if src is not None:
                self.comm.broadcast(unit.full, src)
                unit.adopt_whole()
            unit.unpin()
        for group in self.wholes:
            if src is not None:
                self.comm.broadcast(group.flat_param, src)
                group.adopt_whole()
        for p in self.loose:
            if src is not None:
                self.comm.broadcast(p.data, src)
            self.partitions.reshard(p, self.comm)
