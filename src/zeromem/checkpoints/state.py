"""The small training state a checkpoint holds besides the sharded tensors: RNGs,
scalar optimizer state and param-group options, loss scaler, lr scheduler, step counters.

Each kind has a capture and a restore, over the `Stateful` objects of a
`TrainingState` (scaler, lr scheduler, counters, RNG) or the optimizer. At save,
each rank's generator states go into its own safetensors file (`rng/cpu`,
`rng/cuda<i>`, `rng/numpy`; Python's in the metadata); the rest is JSON
(`consolidate.encode`) in rank 0's manifest (see `checkpoints/save_load.py` for the layout).
At load, `read_rng` and `saved_scalar_state`
read while the checkpoint is staged; the restores run only after everything was
read and checked (`checkpoints._apply`), so a failed load changes nothing. The
masters and per-element optimizer states (the pieces) stay in `checkpoints/save_load.py`.
"""
from __future__ import annotations

import json
import logging
import warnings
from typing import Any

import torch

from zeromem.checkpoints.consolidate import decode, encode, rank_file_name
from zeromem.checkpoints.tensor_files import CheckpointError, TensorSpec
from zeromem.training_state import StepCounters, Stateful, TrainingState

log = logging.getLogger("zeromem")


# ---------------------------------------------------------------- random number generators

def rng_to_file(state: dict[str, Any]) -> tuple[list[TensorSpec], dict[str, str]]:
    """`RngState.state_dict()` as tensors for this rank's safetensors file and metadata strings."""
    specs = [TensorSpec.of("rng/cpu", state["cpu"])]
    specs += [TensorSpec.of(f"rng/cuda{i}", s) for i, s in enumerate(state["cuda"])]
    meta = {"python_rng": json.dumps(encode(state["python"], "python rng"))}
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, gauss = state["numpy"]
        specs.append(TensorSpec.of("rng/numpy", torch.from_numpy(keys.astype(np.int64))))
        meta["numpy_rng"] = json.dumps([name, int(pos), int(has_gauss), float(gauss)])
    return specs, meta


def read_rng(reader, manifest: dict, rank: int) -> dict[str, Any] | None:
    """The generator states `rank` saved (as `RngState.state_dict()` gives them), or None
    when the saved run had no such rank."""
    if rank >= manifest["world_size"]:
        log.info("rank %d had no rank in the saved run (world size %d); its RNG is not restored",
                 rank, manifest["world_size"])
        return None
    file = reader(rank_file_name(rank))
    if "rng/cpu" not in file.keys():  # an imported checkpoint: DeepSpeed saves no generators
        log.info("the checkpoint holds no RNG states; rank %d's generators are left as they are",
                 rank)
        return None
    rng = {"cpu": file.read("rng/cpu"),
           "cuda": [file.read(k) for k in sorted(file.keys()) if k.startswith("rng/cuda")],
           "python": decode(json.loads(file.metadata["python_rng"]))}
    if "rng/numpy" in file.keys():
        import numpy as np
        name, pos, has_gauss, gauss = json.loads(file.metadata["numpy_rng"])
        keys = file.read("rng/numpy").numpy().astype(np.uint32)
        rng["numpy"] = (name, keys, pos, has_gauss, gauss)
    return rng


# ---------------------------------------------------------------- optimizer: scalars and options

def scalar_states(optimizer, group) -> dict[str, Any]:
    """The group's scalar optimizer state (Adam's `step`): what is not a per-element tensor."""
    state = optimizer.state.get(group.master, {})
    return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}


def saved_scalar_state(device: torch.device, group, manifest: dict) -> dict[str, Any]:
    """The scalar optimizer state (Adam's step) the group's parameters had; they must agree."""
    saved = [manifest["params"][s.name]["scalar_state"] for s in group.slots]
    if any(s != saved[0] for s in saved):
        names = [s.name for s in group.slots]
        raise CheckpointError(f"parameters {names} had different scalar optimizer states "
                              f"({saved[0]} vs others); they cannot share one flat group")
    state = decode(saved[0])
    for key, data in saved[0].items():  # tensors go back to the device they were saved from
        if isinstance(data, dict) and data.get("device", "cpu") != "cpu":
            state[key] = state[key].to(device)
    return state


def param_groups_state(optimizer) -> list[Any]:
    """Each optimizer param group's options (lr, betas, ...) as the manifest's JSON."""
    return [encode({k: v for k, v in pg.items() if k != "params"}, f"optimizer param group {i}")
            for i, pg in enumerate(optimizer.param_groups)]


def restore_param_groups(optimizer, manifest: dict) -> None:
    for group, saved in zip(optimizer.param_groups, manifest["optimizer"]["param_groups"]):
        group.update(decode(saved))


# ---------------------------------------------------------------- loss scaler and lr scheduler

def scaler_state(scaler: Stateful) -> Any:
    """The loss scaler's state as the manifest's JSON."""
    return encode(scaler.state_dict(), "loss scaler state")


def restore_scaler(scaler: Stateful, manifest: dict) -> None:
    scaler.load_state_dict(decode(manifest["scaler"]))


def scheduler_state(scheduler: Stateful | None) -> Any:
    """The lr scheduler's state as the manifest's JSON; None without a scheduler."""
    return None if scheduler is None else encode(scheduler.state_dict(), "lr scheduler state")


def restore_scheduler(scheduler, optimizer, manifest: dict) -> None:
    saved = manifest["lr_scheduler"]
    if saved is not None and scheduler is not None:
        scheduler.load_state_dict(decode(saved))
        # The optimizer's lr must be the schedule's even when its own state was not loaded.
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    elif saved is not None or scheduler is not None:
        log.warning("lr scheduler state not restored: the %s has no lr scheduler",
                    "engine" if scheduler is None else "checkpoint")


def continue_schedule(scheduler, steps: int) -> None:
    """An imported run's lr schedule goes on from its step count: the engine's scheduler is
    stepped on to `steps` (torch's `last_epoch`), as if it had run from the start (its own
    formula, chainable or not). One already there or past is left alone, as is one without
    `last_epoch` (warned)."""
    if scheduler is None:
        return
    at = getattr(scheduler, "last_epoch", None)
    if not isinstance(at, int):
        log.warning("lr scheduler %s left where it is: it has no last_epoch to reach the "
                    "imported step %d by", type(scheduler).__name__, steps)
        return
    with warnings.catch_warnings():  # torch's: the optimizer has not stepped since
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        for _ in range(steps - at):
            scheduler.step()


# ---------------------------------------------------------------- fit to the engine, before applying

def check_states(state: TrainingState, manifest: dict, load_optimizer_states: bool,
                 load_lr_scheduler_states: bool) -> None:
    """The saved optimizer options and scheduler state must fit this engine's (same keys,
    compatible types), so that the restores above cannot fail or plant a bad value
    half-way through a load. The manifest's own schema was checked on reading."""
    if load_optimizer_states:
        for i, (group, saved) in enumerate(zip(state.optimizer.param_groups,
                                               manifest["optimizer"]["param_groups"])):
            here = {k: v for k, v in group.items() if k != "params"}
            check_like(decode(saved), here, f"optimizer.param_groups[{i}]")
    scheduler, saved = state.lr_scheduler, manifest["lr_scheduler"]
    if load_lr_scheduler_states and scheduler is not None and saved is not None:
        check_like(decode(saved), scheduler.state_dict(), "lr_scheduler")


def check_like(saved: object, here: object, where: str) -> None:
    """`saved` has the structure of `here`: same keys, same lengths, compatible leaf types.

    Numbers stand for numbers (int or float; not bool), None for any plain value.
    """
    if here is None or saved is None:
        if isinstance(saved, (dict, list, tuple)) or torch.is_tensor(saved):
            raise CheckpointError(f"manifest field {where}: expected a plain value, "
                                  f"got a {type(saved).__name__}")
        return
    if isinstance(here, dict):
        if not isinstance(saved, dict):
            return _need(False, saved, here, where)
        if set(saved) != set(here):
            raise CheckpointError(f"manifest field {where}: keys {sorted(map(str, saved))} do not "
                                  f"match this engine's {sorted(map(str, here))}")
        for k in here:
            check_like(saved[k], here[k], f"{where}.{k}")
    elif isinstance(here, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            return _need(False, saved, here, where)
        _need(type(saved) is type(here) and len(saved) == len(here), saved, here, where)
        for i, (a, b) in enumerate(zip(saved, here)):
            check_like(a, b, f"{where}[{i}]")
    elif isinstance(here, bool) or isinstance(here, str) or torch.is_tensor(here):
        _need(type(saved) is type(here) or torch.is_tensor(saved) and torch.is_tensor(here),
              saved, here, where)
    elif isinstance(here, (int, float)):
        _need(isinstance(saved, (int, float)) and not isinstance(saved, bool), saved, here, where)


def _need(ok: bool, saved: object, here: object, where: str) -> None:
    if not ok:
        raise CheckpointError(f"manifest field {where}: {saved!r} is not like this engine's "
                              f"{here!r} ({type(here).__name__})")


# ---------------------------------------------------------------- step counters

_COUNTS = ("global_steps", "micro_steps", "skipped_steps")


def counters_state(counters: StepCounters) -> dict[str, int]:
    """The manifest's `counters` (its top-level `gradient_accumulation_steps` is the rest)."""
    state = counters.state_dict()
    return {k: state[k] for k in (*_COUNTS, "global_samples")}


def restore_counters(counters: StepCounters, manifest: dict) -> None:
    saved = manifest["counters"]
    counters.load_state_dict({**{k: saved[k] for k in _COUNTS},
                              **({"global_samples": saved["global_samples"]}
                                 if saved.get("global_samples") is not None else {}),
                              "gradient_accumulation_steps":
                                  manifest["gradient_accumulation_steps"]})
