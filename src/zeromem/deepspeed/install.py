"""`install_as_deepspeed()`: zeromem answers where Hugging Face looks for the `deepspeed` package.

Transformers' Trainer and Accelerate enable their DeepSpeed path only when
`importlib.util.find_spec("deepspeed")` finds a module *and*
`importlib.metadata.metadata("deepspeed")` finds a distribution; they then import
a handful of `deepspeed.*` names and unwrap models with
`isinstance(model, deepspeed.DeepSpeedEngine)`. This module registers
`zeromem.deepspeed` under the name `deepspeed` in `sys.modules`, with the
submodules they import (table `_SUBMODULES`), and a metadata finder that reports a
`deepspeed` distribution at version `zeromem.deepspeed.__version__`.

Why an explicit call and not an import side effect: HF decides at import time
(`transformers.integrations.deepspeed` picks its config base class,
`accelerate.utils` its exports), so the switch must run before they are imported.
A late call, or a real DeepSpeed already imported, would let HF wrap zeromem's
engine without recognising it, and `save_model` would write `module.`-prefixed
keys that `from_pretrained` ignores (random weights): both are refused here.
A real DeepSpeed merely installed (DeepSpeed users have it) is shadowed: the module
and the distribution's metadata HF reads both answer as zeromem's surface.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import sys
import types
from typing import Iterable

import torch

NAME = "deepspeed"

# HF modules that read "is deepspeed available?" once, when imported.
_DECIDED_AT_IMPORT = ("transformers.integrations.deepspeed", "transformers.trainer",
                      "accelerate.utils", "accelerate.accelerator")

# What transformers' integrations/deepspeed.py, trainer.py and accelerate's accelerator.py,
# state.py, utils/{deepspeed,other}.py import from `deepspeed` beyond the top-level package.
_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


def _identity_constructor_wrapper(fn, *args, **kwargs):
    """DeepSpeed's `zero_wrapper_for_fp_tensor_constructor`: zeromem's `Init` patches no
    tensor constructor, so the wrapper HF swaps in (for RoPE `arange`) is never called."""
    return fn


class _DeepSpeedOptimizer:
    """DeepSpeed's base class of its ZeRO optimizers (`runtime.base_optimizer`). zeromem's
    optimizers are torch's, so none is one; Lightning Fabric imports it for an
    `isinstance(x, (Optimizer, DeepSpeedOptimizer))` test."""


def _clone_tensors_for_torch_save(item, device: torch.device = torch.device("cpu")):
    """DeepSpeed's `checkpoint.utils.clone_tensors_for_torch_save`: detached copies on `device`."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(_clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: _clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def _submodules() -> dict[str, dict[str, object]]:
    """`deepspeed.<name>` -> the attributes HF reads there (real zeromem modules are aliased)."""
    from . import estimators, runtime_utils, zero
    from .utils import module_utils
    from .engine import DeepSpeedEngine
    from .pipe import PipelineEngine

    return {
        "runtime": {},
        "runtime.engine": {"DeepSpeedEngine": DeepSpeedEngine},
        "runtime.pipe": {}, "runtime.pipe.engine": {"PipelineEngine": PipelineEngine},
        "runtime.lr_schedules": {"VALID_LR_SCHEDULES": list(_LR_SCHEDULES)},
        "runtime.base_optimizer": {"DeepSpeedOptimizer": _DeepSpeedOptimizer,
                                   "ZeROOptimizer": _DeepSpeedOptimizer},
        "runtime.zero": {"Init": zero.Init, "GatheredParameters": zero.GatheredParameters},
        "runtime.zero.partition_parameters": {
            "Init": zero.Init, "GatheredParameters": zero.GatheredParameters,
            "ZeroParamStatus": zero.ZeroParamStatus,
            "zero_wrapper_for_fp_tensor_constructor": _identity_constructor_wrapper,
            "_orig_torch_arange": torch.arange},
        "runtime.zero.offload_config": {"OffloadDeviceEnum": zero.OffloadDeviceEnum,
                                        "OffloadStateTypeEnum": zero.OffloadStateTypeEnum},
        "runtime.utils": {"see_memory_usage": runtime_utils.see_memory_usage},
        "runtime.zero.stage3": {name: getattr(estimators, name) for name in (
            "estimate_zero3_model_states_mem_needs_all_live",
            "estimate_zero3_model_states_mem_needs_all_cold", "model_to_params")},
        "runtime.zero.stage_1_and_2": {name: getattr(estimators, name) for name in (
            "estimate_zero2_model_states_mem_needs_all_live",
            "estimate_zero2_model_states_mem_needs_all_cold")},
        "checkpoint": {},
        "checkpoint.utils": {"clone_tensors_for_torch_save": _clone_tensors_for_torch_save},
        "launcher": {},  # `accelerate launch` reads the name of DeepSpeed's environment file
        "launcher.runner": {"DEEPSPEED_ENVIRONMENT_NAME": ".deepspeed_env"},
        "compression": {},
        "compression.helper": {name: getattr(module_utils, name) for name in (
            "recursive_getattr", "recursive_setattr")},
    }


class _Distribution(importlib.metadata.Distribution):
    """The `deepspeed` distribution `importlib.metadata` reports while the switch is on."""

    def __init__(self, version: str):
        self._metadata = f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n" \
                         "Summary: zeromem.deepspeed installed as deepspeed\n"

    def read_text(self, filename: str) -> str | None:
        return self._metadata if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path):  # no files on disk
        return None


class _MetadataFinder:
    """A `sys.meta_path` entry that finds no modules, only the `deepspeed` distribution."""

    def __init__(self, version: str):
        self.version = version

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()
                           ) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == NAME:
            return [_Distribution(self.version)]
        return []


def is_installed() -> bool:
    """Whether `deepspeed` is zeromem's surface in this process."""
    from .. import deepspeed as surface
    return sys.modules.get(NAME) is surface


def install_as_deepspeed() -> None:
    """Make `import deepspeed` (and HF's checks for it) give `zeromem.deepspeed`.

    Call it once, before importing `transformers` or `accelerate`, in every process
    (first line of the training script). Idempotent. Raises `RuntimeError` when a
    real DeepSpeed is already imported or HF already decided without it.
    """
    from .. import deepspeed as surface

    if is_installed():
        return
    _refuse_if_too_late()
    for dotted, attributes in _submodules().items():
        _register(surface, dotted, attributes)
    for alias in ("accelerator", "comm", "zero", "checkpointing", "moe", "ops", "pipe",
                  "utils"):  # real modules
        sys.modules[f"{NAME}.{alias}"] = getattr(surface, alias)
    for alias in ("moe.utils", "ops.adam", "ops.adagrad", "ops.lion", "utils.zero_to_fp32",
                  "utils.zero_to_torch", "utils.logging", "utils.module_utils"):
        sys.modules[f"{NAME}.{alias}"] = importlib.import_module(f"{surface.__name__}.{alias}")
    sys.modules[NAME] = surface
    # first, so that a real DeepSpeed installed beside zeromem does not answer for the
    # surface: HF would read its version while running zeromem
    sys.meta_path.insert(0, _MetadataFinder(surface.__version__))


def _refuse_if_too_late() -> None:
    """Raise, naming everything imported too early: a real `deepspeed` module (which HF
    imports itself when DeepSpeed is installed), or HF modules that decided without it."""
    early = [f"a 'deepspeed' module ({getattr(sys.modules[NAME], '__file__', '?')})"] \
        if NAME in sys.modules else []
    late = [m for m in _DECIDED_AT_IMPORT if m in sys.modules]
    if late:
        early.append(", ".join(late))
    if early:
        raise RuntimeError(f"install_as_deepspeed: {' and '.join(early)} already imported; call "
                           "zeromem.deepspeed.install_as_deepspeed() first, before importing "
                           "transformers, accelerate or deepspeed")


def _register(surface: types.ModuleType, dotted: str, attributes: dict[str, object]) -> None:
    """Module `deepspeed.<dotted>` holding `attributes`, also an attribute of its parent
    (HF reads `deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES` through attributes)."""
    name = f"{NAME}.{dotted}"
    module = types.ModuleType(name, f"zeromem's stand-in for {name} (zeromem.deepspeed.install)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    parent, _, leaf = dotted.rpartition(".")
    setattr(sys.modules[f"{NAME}.{parent}"] if parent else surface, leaf, module)
