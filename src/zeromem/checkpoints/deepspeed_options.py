"""DeepSpeed's optimizer options and lr schedule, as the engine that loads them holds them.

A DeepSpeed checkpoint keeps each param group's options (lr, betas, ...) as its optimizer
had them, and the schedule's state as its scheduler had it. With the config's optimizer and
scheduler blocks, zeromem builds its own from the saved config and puts the saved values
in; without them, DeepSpeed stepped the script's own optimizer and schedule, and so will
the engine that loads the checkpoint: their saved options and state are kept.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from zeromem.checkpoints.consolidate import encode
from zeromem.checkpoints.tensor_files import CheckpointError

IMPLEMENTATION = {"params", "foreach", "fused", "capturable", "differentiable"}


def optimizer_and_schedule(path: Path, saved: list[dict], model_states: dict,
                           client_kind: str | None, option_keys: frozenset[str]
                           ) -> tuple[tuple[str, list], Any]:
    """(type, param groups' options) as the loading engine's optimizer holds them, and the
    schedule state.

    With an optimizer block, zeromem's own optimizer and schedule are built from DeepSpeed's
    config over empty tensors, so the options carry exactly the keys a zeromem engine's
    have; DeepSpeed's saved values (lr, betas, ...) replace the defaults, implementation
    switches excepted. Without one DeepSpeed stepped the script's own optimizer, which the
    engine steps too: its options are kept as saved. A schedule without a scheduler block
    is the script's own too: its saved state is kept as it is.
    """
    from zeromem.config.schema import OptimizerConfig, SchedulerConfig
    from zeromem.optim.schedulers import build_scheduler

    config = model_states.get("ds_config") or {}
    block, sched_block = config.get("optimizer"), config.get("scheduler")
    try:
        opt_config = OptimizerConfig.model_validate(block) if block else None
        sched_config = SchedulerConfig.model_validate(sched_block) if sched_block else None
    except Exception as error:  # noqa: BLE001 - pydantic or ConfigError: reported with the file
        raise CheckpointError(f"{path}: the ds_config saved in the checkpoint has an optimizer "
                              f"or scheduler zeromem cannot build: {error}") from None
    optimizer: torch.optim.Optimizer
    if opt_config is None:
        kind = client_kind or optimizer_kind(saved)
        as_saved = [{k: v for k, v in g.items()
                     if k != "params" and (k in option_keys or not option_keys)} for g in saved]
        optimizer = torch.optim.SGD([{**g, "params": [torch.zeros(0)]} for g in as_saved])
    else:
        kind, optimizer = opt_config.type.lower(), _config_optimizer(opt_config, saved,
                                                                     option_keys)
    schedule = (model_states.get("lr_scheduler") or None) if sched_config is None else \
        _stepped(build_scheduler(sched_config, optimizer), _scheduler_steps(model_states))
    groups = as_saved if opt_config is None else optimizer.param_groups
    options = [encode({k: v for k, v in g.items() if k != "params"}, f"param group {i}")
               for i, g in enumerate(groups)]
    return (kind, options), encode(schedule, "lr scheduler state")


def optimizer_kind(saved: list[dict]) -> str:
    """The script's optimizer, told from its param groups' options where torch's are (the
    loading engine names it; an engine of another kind refuses its states)."""
    keys = set(saved[0]) if saved else set()
    if {"momentum", "nesterov"} <= keys:
        return "sgd"
    if "betas" in keys:
        return "adamw" if saved[0].get("decoupled_weight_decay") else "adam"
    return "unknown"


def _config_optimizer(opt_config, saved: list[dict], option_keys: frozenset[str]
                      ) -> torch.optim.Optimizer:
    """The config's optimizer over empty tensors, with the saved options it has, and those
    the loading engine's optimizer has too (a script's own schedule, HF's, adds the
    `initial_lr` it starts from)."""
    from zeromem.optim.factory import has_fused_kernel

    cls = opt_config.torch_class
    params = dict(opt_config.params)
    if has_fused_kernel(cls) and not {"foreach", "fused"} & set(params):
        params["fused"] = True  # as zeromem's optimizer_factory.build_optimizer does
    # the saved options this optimizer has: DeepSpeed's FusedAdam keeps its own (bias_correction,
    # a step count) beside them, which would make the group unlike the engine's at load
    defaults = cls([torch.zeros(0)], **params).param_groups[0]
    known = (set(defaults) | option_keys) - IMPLEMENTATION
    # DeepSpeedCPUAdam keeps the config's betas as the JSON list it read; torch's a tuple
    groups = [{"params": [torch.zeros(0)],
               **{k: tuple(v) if isinstance(v, list) and isinstance(defaults.get(k), tuple)
                  else v for k, v in g.items() if k in known}} for g in saved]
    return cls(groups, **params)


def _stepped(scheduler, steps: int) -> dict:
    """The state of `scheduler` after `steps` steps (DeepSpeed's schedule where it stopped)."""
    assert scheduler is not None  # a config block always builds a schedule
    with warnings.catch_warnings():  # stepping a schedule with no optimizer step between
        warnings.simplefilter("ignore")
        for _ in range(steps):
            scheduler.step()
    return scheduler.state_dict()


def _scheduler_steps(model_states: dict) -> int:
    """How many `step()`s DeepSpeed's schedule took: its `last_batch_iteration` starts at -1."""
    return int((model_states.get("lr_scheduler") or {}).get("last_batch_iteration", -1)) + 1
