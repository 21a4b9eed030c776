"""Building the torch optimizer over the engine's fp32 master shards.

The user's param groups (torch style, each with its own lr / weight_decay) map to
flat groups; the optimizer sees one master tensor per flat group, grouped back
into the user's param groups so per-group options keep their meaning.
"""
from __future__ import annotations

import copy
import inspect
import logging
from collections import defaultdict
from functools import partial
from typing import Callable, Iterable

import torch
from torch import nn

from zeromem.optim import muon, optimizers
from zeromem.optim.optimizers import Lamb

log = logging.getLogger("zeromem")

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}

# The engine hands the optimizer flat 1-D master shards, each holding parts of many
# parameters and a parameter's parts spread over the ranks, at every stage. These update
# each element from its own gradient and state only, so stepping a shard is stepping each
# parameter (Lamb's per-parameter ratio is summed over the parts: `split_by_parameter`).
ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
               torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adadelta,
               optimizers.Adam, optimizers.Lion, optimizers.Lamb, muon.ShardedMuon)
# the same, from packages not imported at run time (schedulefree's), by their exact class
ELEMENTWISE_NAMES = ("AdamWScheduleFree", "RAdamScheduleFree", "SGDScheduleFree")
# Optimizers that need each parameter whole, by class name (torch's, and the same names in
# transformers, timm, galore-torch and the Shampoo/SOAP packages), with what they read of it
_FACTORED = ("it factors each matrix's second moment into row and column means and scales each "
             "parameter's step by that parameter's RMS")
_PRECONDITIONED = "it preconditions each weight matrix by statistics of its rows and columns"
_PROJECTED = "it projects each weight matrix's gradient on a low-rank subspace of that matrix"
WHOLE_PARAMETER = {
    "Adafactor": _FACTORED, "GaLoreAdafactor": _FACTORED,
    "Muon": "it orthogonalises each weight matrix's update (Newton-Schulz), which needs the "
            "matrix whole (the config's \"optimizer\": {\"type\": \"Muon\"} gathers it)",
    "LBFGS": "it needs a closure that re-evaluates the loss at each step, and its direction "
             "comes from dot products over every parameter",
    "SparseAdam": "it takes sparse gradients only, and zeromem reduces gradients dense",
    "Shampoo": _PRECONDITIONED, "SOAP": _PRECONDITIONED,
    "GaLoreAdamW": _PROJECTED, "GaLoreAdamW8bit": _PROJECTED,
}


def normalize_param_groups(module: nn.Module, model_parameters: Iterable | None) -> list[dict]:
    """Torch-style param groups of trainable parameters, each parameter once.

    Parameters of `module` that no group names, or that do not require grad, are
    frozen: they get no optimizer state, no gradient buffer and no communication. A
    group's parameter that is not the module's (a loss's learned weight kept beside the
    model) is refused by name: nothing would reduce, shard or save it.
    """
    raw = client_groups(module, model_parameters)
    _refuse_strangers(module, raw)
    groups = [{**group, "params": params} for group, params in trainable_groups(raw)]
    seen = {id(p) for g in groups for p in g["params"]}
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            log.info("parameter %s is in no param group: treated as frozen", name)
            p.requires_grad_(False)
    return groups


def client_groups(module: nn.Module, model_parameters: Iterable | None) -> list[dict]:
    """`model_parameters` as torch's optimizers take them, read once (a generator cannot be
    read twice): param groups, each listing its tensors as given, frozen ones too;
    `module.parameters()` in one group when None."""
    given: list = list(model_parameters) if model_parameters is not None else list(module.parameters())
    raw: list[dict] = given if given and isinstance(given[0], dict) else [{"params": given}]
    return [{**group, "params": _tensors(group["params"])} for group in raw]


def param_order(module: nn.Module, groups: list[dict]) -> list[list[tuple[str, bool]]]:
    """(name, requires grad) of each parameter of each of `client_groups`, in order: what a
    DeepSpeed stage-0 checkpoint's optimizer state numbers by position ("" for a frozen
    tensor that is not the module's)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[(names.get(id(p), ""), p.requires_grad) for p in g["params"]] for g in groups]


def _tensors(params: torch.Tensor | Iterable) -> list:
    """A group's parameters as torch's optimizers take them: one tensor, or an iterable of
    tensors or of (name, tensor) pairs (`model.named_parameters()`, torch 2.6 and later)."""
    if isinstance(params, torch.Tensor):
        return [params]
    return [p[1] if isinstance(p, tuple) else p for p in params]


def _refuse_strangers(module: nn.Module, groups: list[dict]) -> None:
    owned = {id(p) for p in module.parameters()}
    strangers = [(gi, list(p.shape)) for gi, g in enumerate(groups) for p in g["params"]
                 if p.requires_grad and id(p) not in owned]
    if strangers:
        gi, shape = strangers[0]
        more = f" (and {len(strangers) - 1} more)" if len(strangers) > 1 else ""
        raise ValueError(f"param group {gi} holds a parameter of shape {shape} that is not the "
                         f"model's{more}: the engine reduces, shards, steps and saves the "
                         "model's parameters only; make it one (register it on a module of "
                         "the model) before initialize")


def optimizer_param_groups(config, module: nn.Module, model_parameters: Iterable | None
                           ) -> list[dict]:
    """The param groups to lay out (`normalize_param_groups`); for the config's Muon, each
    split into its matrices and the rest (optim/muon.py), which step differently."""
    groups = normalize_param_groups(module, model_parameters)
    return muon.muon_groups(module, groups) if config is not None and config.type == "Muon" \
        else groups


def evaluated_groups(module: nn.Module, stage: int) -> list[dict]:
    """The param group of an engine that only evaluates: at stage 3 every parameter, frozen
    ones too, so that the whole model is sharded (a frozen reference or teacher model, as
    TRL and distillation scripts freeze theirs); below, those that require grad."""
    if stage < 3:
        return normalize_param_groups(module, None)
    return [{"params": list(module.parameters())}]


def trainable_groups(groups: list[dict]) -> list[tuple[dict, list]]:
    """The groups that train something, each with the parameters it trains: those that
    require grad and no earlier group named (a tied weight listed twice is one parameter)."""
    seen: set[int] = set()
    out = []
    for group in groups:
        params = [p for p in group["params"] if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            out.append((group, params))
    return out


def build_optimizer(config, flat_groups: list, param_groups: list[dict],
                    factory: Callable[[list[dict]], torch.optim.Optimizer] | None,
                    device: torch.device) -> torch.optim.Optimizer:
    """The optimizer over master shards: from `factory` or from the config's `optimizer` block;
    with neither, one that keeps no state, for an engine that evaluates only.

    `device`: the engine's (`Runtime.device`); Lamb's per-parameter sums cross the ranks there.
    """
    groups = []
    for gi, pg in enumerate(param_groups):
        options = {k: v for k, v in pg.items() if k != "params"}
        masters = [g.master for g in flat_groups if g.param_group_index == gi]
        groups.append({"params": masters, **options})
    if factory is not None:
        optimizer = factory(groups)
    elif config is None:  # the engine then evaluates only (Engine.trains)
        # no state; never stepped (a frozen model below stage 3 gives it no parameter)
        optimizer = torch.optim.SGD(groups or [{"params": []}], lr=0.0)
    else:
        cls = config.torch_class
        optimizer = cls(groups, **kernel_options(cls, dict(config.params)))
    check_steps_shards(optimizer)
    if isinstance(optimizer, Lamb):
        split_by_parameter(optimizer, flat_groups, device)
    if isinstance(optimizer, muon.ShardedMuon):
        muon.whole_matrices(optimizer, flat_groups, device)
    return optimizer


def check_steps_shards(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that needs whole parameters; warn about one zeromem does not know
    to be elementwise."""
    refuse_whole_parameter(optimizer)
    if not _steps_elementwise(type(optimizer)):
        log.warning("optimizer %s steps zeromem's flat 1-D master shards, each holding parts of "
                    "many parameters: if its update reads a parameter's shape or whole-parameter "
                    "statistics (factored moments, orthogonalisation, per-parameter norms), it "
                    "differs from one process. These are stepped exactly: %s",
                    type(optimizer).__name__, ", ".join(sorted(
                        {*ELEMENTWISE_NAMES, *(cls.__name__ for cls in ELEMENTWISE)})))


def refuse_whole_parameter(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer that needs each parameter whole would step flat shards wrongly (Adafactor)
    or fail inside torch: refused, with the reason and what to use instead."""
    for cls in type(optimizer).__mro__:
        reason = WHOLE_PARAMETER.get(cls.__name__)
        if reason is not None:
            raise NotImplementedError(
                f"optimizer {type(optimizer).__name__} cannot step zeromem's master shards: "
                f"{reason}; zeromem steps flat 1-D shards holding parts of many parameters, at "
                f"every stage. Use an elementwise optimizer ({_names(ELEMENTWISE)})")


def _steps_elementwise(cls: type[torch.optim.Optimizer]) -> bool:
    """Whether `cls` steps with an elementwise class's own `step` (a subclass that only sets
    options, such as deepspeed.ops' FusedAdam); torch wraps `step` in profiling hooks."""
    return cls.__name__ in ELEMENTWISE_NAMES or \
        inspect.unwrap(cls.step) in {inspect.unwrap(known.step) for known in ELEMENTWISE}


def _names(classes: tuple[type, ...]) -> str:
    return ", ".join(sorted({cls.__name__ for cls in classes}))


def split_by_parameter(optimizer: Lamb, flat_groups: list, device: torch.device) -> None:
    """Tell Lamb which parameter each element of each master shard belongs to, and how to
    sum a parameter's parts over the ranks that share its flat group: its trust ratio is
    then the whole parameter's, at any stage and world size."""
    reduce = None
    for g in flat_groups:
        segments = torch.full((g.shard_numel,), len(g.slots), dtype=torch.long)
        for i, slot in enumerate(g.slots):
            start, _, length = g.layout.owned_slice(slot.offset, slot.numel)
            segments[start:start + length] = i
        if g.layout.world > 1 and reduce is None:
            reduce = _summed_over(g.comm, device)
        optimizer.split(g.master, segments, len(g.slots), reduce if g.layout.world > 1 else None)


def _summed_over(comm, device: torch.device) -> Callable[[torch.Tensor], None]:
    """In-place sum over `comm`'s ranks of a small tensor wherever it lives: through `device`,
    the one `comm`'s backend moves tensors on (host masters under NCCL go through the GPU)."""

    def reduce(tensor: torch.Tensor) -> None:
        moved = tensor.to(device)
        comm.all_reduce(moved, kind="lamb_norms")
        if moved is not tensor:
            tensor.copy_(moved)
    return reduce


def kernel_options(cls: type, params: dict) -> dict:
    """`params` with the kernel the engine asks for: torch's fused one where `cls` has it and
    the config names none (one kernel over each master shard: ~7x torch's default
    per-tensor loop on CPU). The step-time calibration times this kernel too."""
    if has_fused_kernel(cls) and not {"foreach", "fused"} & set(params):
        return {**params, "fused": True}
    return params


def has_fused_kernel(cls: type) -> bool:
    """Whether `cls` is a torch optimizer with a `fused` kernel worth asking for (not SGD's)."""
    return cls is not torch.optim.SGD and "fused" in inspect.signature(cls).parameters


def optimizer_state_bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of optimizer state per parameter the paper's K counts besides the fp32 master."""
    defaults = optimizer.defaults
    if hasattr(optimizer, "state_bytes_per_param"):  # zeromem.optim.optimizers
        return optimizer.state_bytes_per_param
    if isinstance(optimizer, torch.optim.Adagrad):
        return 4
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 12 if defaults.get("amsgrad") else 8
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if defaults.get("momentum") else 0
    return 8


def client_optimizer_factory(optimizer: object, model_parameters: Iterable | None
                             ) -> tuple[Callable | None, Iterable | None]:
    """zeromem builds the optimizer over its own master shards: turn a client one into a factory
    (`zeromem.initialize` and DeepSpeed's `initialize` both take either).

    A ready `torch.optim.Optimizer` is stepped over the masters (`over_masters`) with its
    own param groups, `model_parameters` aside, as DeepSpeed does; a callable is already
    a factory. One that needs whole parameters is refused here, before `initialize`
    partitions anything.
    """
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, model_parameters  # type: ignore[return-value]  # a factory, or None
    refuse_whole_parameter(optimizer)  # before the model is touched
    # An FSDP2 loop steps the optimizer it built: over the module's parameters, whose
    # gradients the engine takes, that step would silently change nothing. A scheduler
    # built over it before (HF's Trainer) still sets the lr the engine's copy reads: torch's
    # mark keeps it from warning that the step it wrapped was replaced.
    refusing = partial(_stepped_by_the_engine, type(optimizer).__name__)
    refusing._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = refusing  # type: ignore[method-assign, assignment]
    return partial(over_masters, optimizer), optimizer.param_groups


def _stepped_by_the_engine(name: str, *args: object, **kwargs: object) -> None:
    raise RuntimeError(f"{name}.step(): this optimizer was given to initialize, which steps "
                       "a copy of it over the engine's master shards; call engine.step() "
                       "(with DeepSpeed's API, also the optimizer initialize returned)")


def over_masters(client: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """The client's optimizer over zeromem's master shards (`groups`, one per client group
    that trains something, in order): a copy of it whose param groups are the client's own
    group dicts, their parameters replaced by the masters (DeepSpeed puts its fp32
    partitions there too). A scheduler built over the client before `initialize` (HF's
    Trainer and DeepSpeed-Chat do so) then keeps setting the lr this optimizer reads."""
    optimizer = copy.copy(client)  # its class and defaults (torch's Optimizer copies as
    optimizer.param_groups, optimizer.state = [], defaultdict(dict)  # those, groups, state)
    sources = [group for group, _ in trainable_groups(client.param_groups)]
    for source, group in zip(sources, groups, strict=True):
        source["params"] = group["params"]
        optimizer.add_param_group(source)
    # The client never steps: its schedulers would warn at their first step that it had not
    client._opt_called = True  # type: ignore[attr-defined]  # torch's LRScheduler check
    return optimizer
