"""The user's module and the engine's copies of it stay one model.

Two moments at which they could part (issue 10):

- At `initialize`, ranks may hold different values (a script that does not seed
  every rank alike). As DDP and DeepSpeed do at construction, rank 0's
  parameters and buffers are broadcast to every data-parallel rank
  (`broadcast_from_rank0`): in the user's own dtype, before flattening (so the
  fp32 masters built next are identical), one tensor at a time and in place, so
  no rank ever holds more than the model once, and at stage 3 this happens
  before sharding. Parameters built under `zeromem.Init` are already
  partitioned (empty here) and identical by construction; they are skipped.

  Buffers are broadcast at `initialize` only, as DeepSpeed does (DDP's default
  re-broadcasts them before every forward). Afterwards each rank updates its own
  (BatchNorm running statistics follow that rank's micro-batches) and
  checkpoints keep rank 0's; use `nn.SyncBatchNorm` for statistics over the
  global batch.

- `engine.module.load_state_dict(...)` makes torch copy the incoming values into
  the compute-dtype parameters only, while the optimizer steps the fp32 masters,
  whose next write-back would silently restore the old weights (and at stage 3
  the parameters are empty between gathers). `LoadIntoMasters` hooks every
  module: a load-state-dict pre-hook captures the incoming tensors of the
  module's trained parameters (full precision, before any rounding) and, where a
  stage-3 parameter is empty, hands torch an empty value in their place; when the
  outermost `load_state_dict` finishes, this rank's part of each captured value
  goes into its master and, at stage 3, into its parameter shard. No collective
  runs, so a load on one rank only changes that rank, as in torch.

- At stage 3, `engine.module.state_dict()` outside a gather holds each rank's empty
  shards, as in DeepSpeed: saved, it would not be the model. `warn_sharded_state_dict`
  says so once, naming what gives the model.

A model with a lazy module (`nn.LazyLinear`) whose first forward has not run has
no values to share yet, and a complex parameter no place in a real flat buffer;
`initialize` refuses both by name (`refuse_untakeable`). A model built on the meta
device gets its values from its modules' `reset_parameters()` (`materialize_meta`);
one whose tensors none of them set is refused by name.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeromem.comm import Comm
from zeromem.flat import FlatParamGroup
from zeromem.layout import ParamSlot

if TYPE_CHECKING:
    from zeromem.offload.placement import Offload

log = logging.getLogger("zeromem")


def refuse_untakeable(module: nn.Module) -> None:
    """Parameters the engine cannot flatten, named with what to do: a lazy module's
    (nn.LazyLinear), which do not exist before its first forward, and complex ones (the
    flat buffers hold real numbers)."""
    unmade = (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)
    named = [*module.named_parameters(), *module.named_buffers()]
    lazy = [name for name, t in named if isinstance(t, unmade)]
    if lazy:
        raise ValueError(f"parameter {_some(lazy)} is not made yet: a lazy module makes its "
                         "parameters at its first forward; run the model once on a sample "
                         "batch before initialize")
    complex_ = [name for name, p in module.named_parameters() if p.is_complex()]
    if complex_:
        raise ValueError(f"parameter {_some(complex_)} is complex: zeromem flattens real "
                         "parameters only; hold it as a real tensor whose last dimension is 2 "
                         "(torch.view_as_real) and view it as complex in forward "
                         "(torch.view_as_complex)")


def _some(names: list[str]) -> str:
    return f"{names[0]!r}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def materialize_meta(module: nn.Module, device: torch.device) -> None:
    """Give a model built on the meta device real storage, module by module.

    Each module with meta tensors gets `to_empty` on `device` and its own
    `reset_parameters()`, in module order, so standard layers get the values an
    ordinary build would under the same seed (custom init schemes are not replayed).
    A tensor no `reset_parameters()` sets (a norm's ones, a rotary embedding's
    frequencies, set in a custom module's __init__) would keep whatever memory held:
    refused by name. The whole model exists once before sharding; to bound memory
    while building, or for such modules, use `zeromem.Init` instead.
    """
    unset = []
    for prefix, m in module.named_modules():
        if not any(t.is_meta for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]):
            continue
        m.to_empty(device=device, recurse=False)
        own = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        with torch.no_grad():
            for _, t in own:
                _mark_unset(t)
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
        unset += [f"{prefix}.{name}".lstrip(".") + f" ({type(m).__name__})"
                  for name, t in own if _still_unset(t, callable(reset))]
    if unset:
        more = f" and {len(unset) - 3} more" if len(unset) > 3 else ""
        raise ValueError(f"{', '.join(unset[:3])}{more}: built on the meta device, and no "
                         "reset_parameters() gives them values, so they would hold "
                         "whatever memory held; build the model under zeromem.Init, or "
                         "give it its values before initialize (model.to_empty(device=...) "
                         "and your own init)")


def _mark_unset(t: torch.Tensor) -> None:
    """A value no initialisation writes: NaN, or an integer type's minimum."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool and not t.is_complex():
        t.fill_(torch.iinfo(t.dtype).min)


def _still_unset(t: torch.Tensor, was_reset: bool) -> bool:
    if t.is_floating_point():
        return bool(t.isnan().any())
    if t.dtype == torch.bool or t.is_complex():
        return not was_reset  # no mark to look for: only a reset can have set it
    return bool((t == torch.iinfo(t.dtype).min).any())


def broadcast_from_rank0(module: nn.Module, comm: Comm) -> None:
    """Give every rank rank 0's parameters and buffers (in place; collective)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.numel():  # empty: partitioned under zeromem.Init, identical already
                comm.broadcast(tensor.data, 0)


class LoadIntoMasters:
    """Weights loaded into the module reach the fp32 masters (and stage-3 shards)."""

    def __init__(self, module: nn.Module, groups: list[FlatParamGroup], offload: Offload):
        self.offload = offload  # where masters and shards live (offload/placement.py)
        self.slot_of: dict[int, tuple[FlatParamGroup, ParamSlot]] = {
            id(p): (g, slot) for g in groups for p, slot in zip(g.params, g.slots)}
        self.top: nn.Module | None = None  # the module whose load_state_dict is running
        self.loaded: dict[int, torch.Tensor] = {}  # parameter id -> incoming value, this load
        self.handles = []
        for m in module.modules():
            own = [(name, p) for name, p in m.named_parameters(recurse=False, remove_duplicate=False)
                   if id(p) in self.slot_of]  # a tied weight is loaded under each of its names
            self.handles.append(m.register_load_state_dict_pre_hook(partial(self._capture, own)))
            self.handles.append(m.register_load_state_dict_post_hook(self._finish))

    def _capture(self, own: list[tuple[str, nn.Parameter]], module: nn.Module,
                 state_dict: dict, prefix: str, local_metadata: dict, *_) -> None:
        if prefix == "":  # torch calls the outermost module with an empty prefix
            self.top, self.loaded = module, {}
        if own and local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError(
                f"load_state_dict(assign=True) on '{type(module).__name__}' would replace "
                "parameters that zeromem keeps as views of its flat buffers; load without assign")
        for name, p in own:
            value = state_dict.get(prefix + name)
            slot = self.slot_of[id(p)][1]
            if not torch.is_tensor(value) or value.shape != slot.shape:
                continue  # torch reports the missing key or the size mismatch
            self.loaded[id(p)] = value
            if p.numel() == 0 < slot.numel:
                # Stage 3 between gathers: the shard is the only copy. torch's copy into
                # the empty parameter must neither fail nor count as a mismatch.
                state_dict[prefix + name] = value.new_empty(0)

    def _finish(self, module: nn.Module, incompatible_keys: object) -> None:
        if module is not self.top:
            return
        loaded, self.top, self.loaded = self.loaded, None, {}
        if loaded:
            self._write(loaded)

    def _write(self, loaded: dict[int, torch.Tensor]) -> None:
        """This rank's part of each loaded value into its master, then into its shard."""
        with torch.no_grad():
            with self.offload.all_in_memory():  # masters on NVMe come back for the write
                for pid, value in loaded.items():
                    g, slot = self.slot_of[pid]
                    start, at, n = g.owned_slice(slot)
                    if n and not g.master_aliases_params():
                        g.master[start:start + n].copy_(value.detach().reshape(-1)[at:at + n])
            params = self.offload.params  # where the parameter shards live (offload/params.py)
            for pid, value in loaded.items():
                g, slot = self.slot_of[pid]
                start, at, n = g.owned_slice(slot)
                if n and g.flat_param is None:  # stage 3: torch's copy did not reach the shard
                    params.store(g, start, value.detach().reshape(-1)[at:at + n])
            params.flush()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def warn_sharded_state_dict(module: nn.Module) -> None:
    """Warn once when `module.state_dict()` holds partitioned parameters' empty shards.
    Not inside a gather (whole then), nor with `keep_vars=True` (the parameters
    themselves: zeromem's checkpoints and HF's export read the keys so). HF's Trainer,
    PEFT and TRL take it knowingly and gather, or warn, themselves: an error would stop
    them."""
    said: list[bool] = []

    def taken(root: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        if said or any(isinstance(v, nn.Parameter) for v in state_dict.values()):
            return
        if not any(p.numel() == 0 and getattr(p, "ds_numel", 0) for p in root.parameters()):
            return
        said.append(True)
        log.warning("state_dict() of a ZeRO-3 module outside a gather: its partitioned "
                    "parameters are this rank's empty shards (size 0), not the model. Take "
                    "it inside zeromem.GatheredParameters(list(module.parameters())), or use "
                    "engine.full_state_dict() or engine.save_16bit_model(dir) (on every rank)")
    module.register_state_dict_post_hook(taken)


def gathered_params(groups: list[FlatParamGroup], comm: Comm, dtype: torch.dtype,
                    keep: bool) -> dict[int, torch.Tensor]:
    """Parameter id -> the whole parameter on the CPU where `keep` ({} elsewhere), from the
    groups' masters in `dtype` (a frozen group's shard, in its own dtype), gathered one group
    at a time; collective over `comm`."""
    gathered: dict[int, torch.Tensor] = {}
    for g in groups:
        whole = g.master.detach().float().contiguous()
        if g.shard_world > 1:
            shard, whole = whole, torch.empty(g.padded_numel, dtype=torch.float32,
                                              device=whole.device)
            comm.all_gather(whole, shard)
        if keep:
            kept = dtype if g.trains else g.param_shard.dtype
            for p, s in zip(g.params, g.slots):
                gathered[id(p)] = whole[s.offset:s.offset + s.numel].view(s.shape).to(
                    device="cpu", dtype=kept, copy=True)
    return gathered


def gathered_state_dict(module: nn.Module, groups: list[FlatParamGroup], comm: Comm,
                        dtype: torch.dtype, keep: bool) -> dict[str, torch.Tensor]:
    """The module's whole state dict where `keep` ({} elsewhere); collective over `comm`,
    the shards' group (under hybrid sharding every block gathers, so the caller says which
    rank keeps it). Trained parameters are the fp32 masters in `dtype`, gathered one flat
    group at a time; other tensors (buffers, frozen parameters) as held, copied to the CPU."""
    gathered = gathered_params(groups, comm, dtype, keep)
    if not keep:
        return {}
    return {key: gathered[id(t)] if id(t) in gathered else t.detach().cpu().clone()
            for key, t in module.state_dict(keep_vars=True).items() if torch.is_tensor(t)}
