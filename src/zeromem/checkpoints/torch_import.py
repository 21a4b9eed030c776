"""FSDP2 / DCP checkpoints turned into zeromem checkpoints.

A run saved with `torch.distributed.checkpoint` (DCP: FSDP2 scripts, torchtitan,
Accelerate's FSDP `save_state`) continues under zeromem from its directory
(`engine.load_checkpoint("step-1000")`, read by dcp_read.py without running its pickles),
or from the one file torch's `dcp_to_torch_save` makes of it, read with `weights_only=True`
(tensors, containers, numbers, strings) and memory-mapped: weights, optimizer states and
step count, at any world size and stage. The folder Accelerate's `save_state` writes
otherwise (FSDP's full state dict: `pytorch_model_fsdp.bin`; DDP or one process:
`model.safetensors`; beside `optimizer.bin`), or a Hugging Face Trainer checkpoint-N
(`model.safetensors`, `optimizer.pt`), is read the same way, file by file.

What the checkpoint holds, as the state dict the run saved:

    {"model": {fqn: tensor}, "optimizer": {...}}      FSDP2 with get_state_dict
    {fqn: tensor, ..., "optimizer": {...}}            torchtitan (model keys at the top)

and the optimizer entry in either of `get_optimizer_state_dict`'s layouts, or as torch's
own `optimizer.state_dict()` numbers the parameters (one param group over the model's
parameters, in its order: a plain DDP or one-process script's checkpoint loads too):

    {"state": {fqn: {"exp_avg": t, "step": t}}, "param_groups": [{..., "params": [fqn]}]}
    {"state.<fqn>.exp_avg": t, ..., "param_groups.<fqn>.lr": 0.1, ...}   (flattened)
    {"state": {0: {...}}, "param_groups": [{..., "params": [0, 1, ...]}]}  (numbered)

The import fills the manifest the loading engine would itself save (`template`: names,
shapes, param groups, module tensors, tied weights) with the file's values, and writes it
as a one-rank zeromem checkpoint, which the ordinary loader then checks and reads; a file
of another model, or of another optimizer kind, is refused before anything changes.
Chosen where torch and zeromem differ: a trained parameter without optimizer state in the
file (it never had a gradient) gets zero moments and the others' step; the param groups'
options (lr, betas, ...) are the file's, their implementation switches (fused, foreach)
the engine's; the loss scaler, RNGs and lr schedule stay the engine's (DCP keeps the
script's in entries of its own), the schedule stepped on to the imported step count
(save_load.py, `continue_schedule`); the step count is torchtitan's `train_state` step,
else Adam's, else 0 (SGD).
"""
from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import torch

from zeromem.checkpoints.consolidate import decode, encode, write_one_rank
from zeromem.checkpoints.dcp_read import dcp_directories, read_dcp
from zeromem.checkpoints.deepspeed_options import IMPLEMENTATION, optimizer_kind
from zeromem.checkpoints.tensor_files import CheckpointError, TensorSpec

OPTIMIZER_KEYS = ("optimizer", "optim")  # where FSDP2 scripts and torchtitan keep it
IMPORTED = "imported"  # the tag of the one-rank checkpoint the import writes
# the model's and the optimizer's files of Accelerate's save_state (FSDP with
# FULL_STATE_DICT; DDP or one process) and of a Hugging Face Trainer checkpoint-N
MODEL_FILES = ("pytorch_model_fsdp.bin", "model.safetensors", "pytorch_model.bin")
OPTIMIZER_FILES = ("optimizer.bin", "optimizer.pt")


def write_torch_state(file: Path, dst: Path, template: dict, optimizer_states: bool) -> str:
    """The file's state as a one-rank zeromem checkpoint under `dst`, its manifest
    `template` (the loading engine's own) filled with the file's values; returns its tag."""
    model, optimizer, step = _read(file)
    manifest = dict(copy.deepcopy(template), world_size=1, client_state=None)
    model = _unwrapped(model, manifest)
    names = _check_keys(file, model, manifest)
    specs = [TensorSpec.of(f"master/{n}", _value(file, model, n, manifest).float().flatten())
             for n in names]
    module = {k: _value(file, model, k, manifest) for k in manifest["module_tensors"]}
    specs += [TensorSpec.of(f"module/{k}", t) for k, t in module.items()]
    manifest["module_tensors"] = {k: {"shape": list(t.shape),
                                      "dtype": str(t.dtype).removeprefix("torch.")}
                                  for k, t in module.items()}
    if optimizer_states:
        if optimizer is None:
            raise CheckpointError(f"{file} holds no optimizer state (no {' or '.join(OPTIMIZER_KEYS)} "
                                  "entry): pass load_optimizer_states=False to load its weights")
        specs += _optimizer_into(file, optimizer, manifest, names)
        step = _adam_step(manifest, names) if step is None else step
    if step is not None:
        gas = manifest["gradient_accumulation_steps"]
        manifest["counters"] = {"global_steps": step, "micro_steps": step * gas,
                                "skipped_steps": 0, "global_samples": None}
    tag = manifest["tag"] = IMPORTED  # not the file's name: "latest.pt" would be the pointer
    write_one_rank(dst, tag, specs, manifest)
    return tag


# ---------------------------------------------------------------- the file

def _read(file: Path) -> tuple[dict[str, torch.Tensor], dict | None, int | None]:
    """(model state dict, optimizer state dict or None, the trainer's step count or None)
    of the file or folder. torch.load reads a .safetensors file too: weights only, at the
    top (a Hugging Face model file, or `zeromem consolidate`'s: tied keys once)."""
    saved = _load_directory(file) if file.is_dir() else _load_file(file)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{file} holds a {type(saved).__name__}, not a state dict")
    optimizer = next((saved[k] for k in OPTIMIZER_KEYS if isinstance(saved.get(k), dict)), None)
    model = saved["model"] if isinstance(saved.get("model"), dict) else \
        {k: v for k, v in saved.items() if torch.is_tensor(v)}
    step = (saved.get("train_state") or {}).get("step") \
        if isinstance(saved.get("train_state"), dict) else None  # torchtitan's TrainState
    return model, optimizer, int(step) if isinstance(step, (int, torch.Tensor)) else None


def is_torch_state(path: Path) -> bool:
    """Whether `path` is a run's state this module reads: a file, a DCP directory, or the
    folder Accelerate's `save_state` or the Hugging Face Trainer writes (a model file and
    an optimizer file; FSDP's full state dict file alone too)."""
    return path.is_file() or dcp_directories(path) is not None or \
        _state_files(path) is not None


def _state_files(directory: Path) -> tuple[Path, Path | None] | None:
    """(model file, optimizer file or None) of a save_state / Trainer folder, or None."""
    if not directory.is_dir() or (directory / "latest").is_file():
        return None  # a DeepSpeed or zeromem checkpoint, read as such
    model = next((directory / n for n in MODEL_FILES if (directory / n).is_file()), None)
    optimizer = next((directory / n for n in OPTIMIZER_FILES if (directory / n).is_file()), None)
    if model is None or (optimizer is None and model.name != MODEL_FILES[0]):
        return None  # a model alone is a Hugging Face model folder (from_pretrained's)
    return model, optimizer


def _load_directory(directory: Path) -> dict[str, Any]:
    """A DCP directory (or Accelerate's two), or a save_state / Trainer folder's files."""
    dcp = dcp_directories(directory)
    if dcp is not None:
        return read_dcp(dcp, needed=("model", *OPTIMIZER_KEYS, "train_state"))
    files = _state_files(directory)
    assert files is not None  # is_torch_state said so
    model, optimizer = files
    return {"model": _load_file(model),
            **({"optimizer": _load_file(optimizer)} if optimizer is not None else {})}


def _load_file(file: Path) -> Any:
    try:  # DCP hands its byte entries back as BytesIO (torchtitan's older train_state)
        with torch.serialization.safe_globals([io.BytesIO]):
            # mapped, not read: every rank imports the whole file, and the ranks of a node
            # then share its pages instead of each holding a copy of the model's states
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{file} is not a torch file of tensors, containers, numbers and "
                              f"strings (torch.load with weights_only=True: {first})") from None


# what wrappers add to a module's keys: DDP's module., torch.compile's _orig_mod. and the
# activation checkpoint wrapper's (FSDP2's get_state_dict leaves them out; a script's own
# model.state_dict() of a wrapped model has them)
WRAPPER_PARTS = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def _unwrapped(model: dict, manifest: dict) -> dict:
    """The file's model keys without wrappers' parts, where this model's keys have none."""
    keys = set(manifest["state_dict_keys"])
    if set(model) <= keys:
        return model
    stripped = {_strip(k): v for k, v in model.items()}
    return stripped if len(stripped) == len(model) and set(stripped) <= keys else model


def _strip(key: str) -> str:
    key = key.removeprefix("module.")
    for part in WRAPPER_PARTS[1:]:
        key = key.replace(part, "")
    return key


def _check_keys(file: Path, model: dict, manifest: dict) -> list[str]:
    """The trained parameters' names; the file's model keys must be this model's."""
    keys = set(manifest["state_dict_keys"])
    extra = sorted(k for k in model if k not in keys)
    missing = sorted(k for k in keys if k not in model and k not in manifest["aliases"])
    if extra or missing:
        raise CheckpointError(f"{file} is from another model: "
                              + (f"it has {extra[:5]}, which this model lacks" if extra else
                                 f"it lacks {missing[:5]}, which this model has"))
    return list(manifest["params"])


def _value(file: Path, model: dict, name: str, manifest: dict) -> torch.Tensor:
    """The file's tensor for `name`, under it or under one of its tied names, of the shape
    this model has."""
    value = model.get(name)
    for alias, canonical in manifest["aliases"].items():
        if value is None and canonical == name:
            value = model.get(alias)
    if not torch.is_tensor(value):
        raise CheckpointError(f"{file} has no tensor {name!r} (saved: {type(value).__name__})")
    entry = manifest["params"].get(name) or manifest["module_tensors"][name]
    if list(value.shape) != list(entry["shape"]):
        raise CheckpointError(f"{file} is from another model: {name!r} has shape "
                              f"{list(value.shape)} there and {entry['shape']} here")
    return value.detach()


# ---------------------------------------------------------------- the optimizer

def _entries(file: Path, optimizer: dict, manifest: dict
             ) -> tuple[dict[str, dict[str, Any]], list[dict]]:
    """({fqn: its states}, [param group options with "params": [fqn]]) from either layout."""
    if "state" in optimizer or "param_groups" in optimizer:
        listed = list(optimizer.get("param_groups", []))
        if any(not isinstance(p, str) for g in listed for p in g.get("params", [])):
            return _named(file, dict(optimizer.get("state", {})), listed, manifest)
        return dict(optimizer.get("state", {})), listed
    states: dict[str, dict[str, Any]] = {}
    options: dict[str, dict[str, Any]] = {}
    for key, value in optimizer.items():
        kind, _, rest = key.partition(".")
        fqn, _, leaf = rest.rpartition(".")
        if kind == "state":
            states.setdefault(fqn, {})[leaf] = value
        elif kind == "param_groups":
            options.setdefault(fqn, {})[leaf] = value
    groups: list[dict] = []
    for fqn, opts in options.items():  # the flattened layout keeps options per parameter
        group = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == opts),
                     None)
        if group is None:
            groups.append(group := {**opts, "params": []})
        group["params"].append(fqn)
    return states, groups


def _named(file: Path, states: dict, groups: list[dict], manifest: dict
           ) -> tuple[dict[str, dict[str, Any]], list[dict]]:
    """torch's own `optimizer.state_dict()` numbers the parameters in the order its param
    groups list them. One group built from `model.parameters()` (all of them, or the
    trained ones) lists them in the model's order; several groups (nanoGPT's and Hugging
    Face's decay / no-decay) are read as the engine's own groups, in order, each listing
    its parameters in the model's order, as both recipes build them. Anything else is
    refused, as is a state whose shape is not its parameter's (`_optimizer_into`)."""
    params = manifest["params"]
    frozen = set(manifest.get("frozen_parameters") or [])
    every = [k for k in manifest["state_dict_keys"]
             if k not in manifest["aliases"] and (k in params or k in frozen)]
    orders = _numbered_orders(groups, every, params, len(manifest["optimizer"]["param_groups"]))
    if orders is None:
        counts = [len(g.get("params", [])) for g in groups]
        mine = [sum(1 for k in every if params.get(k, {}).get("param_group") == i)
                for i in range(len(manifest["optimizer"]["param_groups"]))]
        raise CheckpointError(
            f"{file}: the optimizer numbers its parameters (torch's optimizer.state_dict()) in "
            f"{len(groups)} param groups of {counts}, not one group of this model's "
            f"{len(every)} parameters (or {len(params)} trained ones) in the model's order, nor "
            f"this engine's param groups ({mine} trained parameters); give the engine the "
            "saving run's groups (zeromem.initialize(model, config, model_parameters=groups)), "
            "or save it with torch.distributed.checkpoint.state_dict.get_state_dict, which "
            "names them")
    name = {int(n): k for g, order in zip(groups, orders) for n, k in zip(g["params"], order)}
    return ({name[int(n)]: v for n, v in states.items()},
            [{**g, "params": order} for g, order in zip(groups, orders)])


def _numbered_orders(groups: list[dict], every: list[str], params: dict, engine_groups: int
                     ) -> list[list[str]] | None:
    """The names each numbered group lists, in its order; None where that is not clear."""
    counts = [len(g.get("params", [])) for g in groups]
    if len(groups) == 1:
        return next(([o] for o in (every, [k for k in every if k in params])
                     if len(o) == counts[0]), None)
    mine = [[k for k in every if params.get(k, {}).get("param_group") == i]
            for i in range(engine_groups)]
    return mine if [len(m) for m in mine] == counts else None


def _optimizer_into(file: Path, optimizer: dict, manifest: dict, names: list[str]
                    ) -> list[TensorSpec]:
    """The file's optimizer states and options into `manifest`; the per-element states' specs."""
    states, groups = _entries(file, optimizer, manifest)
    kind = optimizer_kind(groups)
    if kind != manifest["optimizer"]["type"]:
        raise CheckpointError(f"{file} holds {kind} optimizer states but this engine uses "
                              f"{manifest['optimizer']['type']}; pass load_optimizer_states=False")
    found = {n: _states_of(n, states, manifest) for n in names}
    kinds = sorted({k for s in found.values() for k, v in s.items() if v.dim() > 0})
    # one step for all: zeromem steps a flat group's parameters together, and a parameter
    # that never had a gradient has none in the file
    scalars = {k: max((s[k] for s in found.values() if k in s), key=float)
               for k in {k for s in found.values() for k, v in s.items() if v.dim() == 0}}
    specs = []
    for n in names:
        shape = manifest["params"][n]["shape"]
        for k in kinds:
            value = found[n].get(k, torch.zeros(shape))
            if list(value.shape) != list(shape):
                raise CheckpointError(f"{file}: optimizer state {k!r} of {n!r} has shape "
                                      f"{list(value.shape)}, the parameter {shape}")
            specs.append(TensorSpec.of(f"optimizer/{k}/{n}", value.float().flatten()))
        manifest["params"][n] = dict(manifest["params"][n],
                                     scalar_state=encode(scalars, "optimizer state"))
    opt = manifest["optimizer"]
    manifest["optimizer"] = dict(opt, tensor_states=kinds,
                                 param_groups=_options(file, groups, opt["param_groups"], manifest))
    manifest["dtypes"] = dict(manifest["dtypes"], optimizer={k: "float32" for k in kinds})
    return specs


def _adam_step(manifest: dict, names: list[str]) -> int | None:
    """The step count the imported optimizer states keep (Adam's), if they keep one."""
    saved = decode(manifest["params"][names[0]]["scalar_state"]) if names else {}
    step = saved.get("step")
    return int(step) if step is not None else None


def _states_of(name: str, states: dict, manifest: dict) -> dict[str, torch.Tensor]:
    """The file's states of trained parameter `name` (or of a tied name), tensors only."""
    found = states.get(name)
    for alias, canonical in manifest["aliases"].items():
        if found is None and canonical == name:
            found = states.get(alias)
    return {k: v for k, v in (found or {}).items() if torch.is_tensor(v)}


def _options(file: Path, groups: list[dict], here: list, manifest: dict) -> list:
    """Each engine param group's options: the file's values (its implementation switches
    aside) for the options the engine's group has, from the file's group holding its
    parameters."""
    of: dict[str, int] = {p: j for j, g in enumerate(groups) for p in g.get("params", [])}
    for alias, canonical in manifest["aliases"].items():
        if alias in of:
            of.setdefault(canonical, of[alias])
    out = []
    for i, encoded in enumerate(here):
        mine = [n for n, p in manifest["params"].items() if p["param_group"] == i]
        saved = {of[n] for n in mine if n in of}
        if len(saved) > 1:
            raise CheckpointError(f"{file}: this engine's param group {i} holds parameters of "
                                  f"the file's groups {sorted(saved)}; give the engine "
                                  "the saving run's param groups: zeromem.initialize(model, "
                                  "config, model_parameters=groups)")
        options = decode(encoded)
        if saved:
            source = groups[saved.pop()]
            options.update({k: _like(source[k], v) for k, v in options.items()
                            if k in source and k not in IMPLEMENTATION})
        out.append(encode(options, f"optimizer param group {i}"))
    return out


def _like(saved: Any, here: Any) -> Any:
    """A saved option in the engine's container type (torch keeps betas as a tuple)."""
    return tuple(saved) if isinstance(here, tuple) and isinstance(saved, list) else saved
