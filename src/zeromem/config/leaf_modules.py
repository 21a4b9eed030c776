"""`zero_optimization.leaf_module`: the stage-3 modules each gathered whole, as one fetch unit.

DeepSpeed's ZeRO-3 leaf modules. A sparse mixture-of-experts block needs it: each rank runs
the experts its own tokens picked, in the order they picked them, so per-expert gathers
would differ between ranks; gathered as one unit on entry, every rank gathers the same.
A module is named by its class (the class's name or module-qualified name, the class
itself and not its subclasses), by its name in `named_modules()`, or by the end of that
name, as DeepSpeed matches them. The default classes are DeepSpeed's (0.18 on): HF's
Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks, made leaves in any model that has them.
Modules `deepspeed.utils.set_z3_leaf_modules` flagged (DeepSpeed's `_z3_leaf` attribute)
are leaves too. The stage-3 fetch units never split a leaf (stage3/units.py).
"""
from __future__ import annotations

import logging
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from torch import nn

from zeromem.config.types import _Block

log = logging.getLogger("zeromem")

DEFAULT_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def class_named(module: nn.Module, name: str) -> bool:
    """Is `module`'s class the one `name` names (its name or module-qualified name)?"""
    cls = type(module)
    return name in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _listed(value: Any) -> Any:
    return [value] if isinstance(value, str) else value  # one name given bare, as DeepSpeed takes it


Names = Annotated[list[str], BeforeValidator(_listed)]


class LeafModuleConfig(_Block):
    """`zero_optimization.leaf_module`: `classes`, `names` and `name_suffixes` of the modules
    gathered whole (the module docstring says how each is matched)."""

    classes: Names = Field(default_factory=lambda: list(DEFAULT_CLASSES))
    names: Names = Field(default_factory=list)
    name_suffixes: Names = Field(default_factory=list)

    def modules(self, root: nn.Module) -> list[nn.Module]:
        """The leaf modules of `root`, in module order: those this block names, and those
        flagged by `deepspeed.utils.set_z3_leaf_modules`. A name, suffix or
        class of the config's own that matches nothing is warned about (the default
        classes match nothing in most models)."""
        found, used = [], set()
        for name, module in root.named_modules():
            hits = [c for c in self.classes if class_named(module, c)]
            hits += [n for n in self.names if n == name]
            hits += [s for s in self.name_suffixes if name.endswith(s)]
            if hits or getattr(module, "_z3_leaf", False):
                found.append(module)
                used.update(hits)
        unmatched = [key for key in (*self.classes, *self.names, *self.name_suffixes)
                     if key not in used and key not in DEFAULT_CLASSES]
        if unmatched:
            log.warning("zero_optimization.leaf_module: %s match no module of %s; those "
                        "modules are gathered as usual", unmatched, type(root).__name__)
        return found
