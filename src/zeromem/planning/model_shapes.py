"""Models on the meta device, and the planner's view of them (`ModelShape`).

`load_model` builds a model without allocating it, from a factory path
(`package.module:function` or `path/file.py:function`) or from a Hugging
Face-style config JSON: the model transformers builds from it, or, without
transformers, `ConfigGPT`: a dense stand-in (GPT-2, Llama and look-alikes) with the
parameter shapes and module structure the config describes. `shape_of` reads a model's
parameter sizes, fetch units and dimensions into the `ModelShape` that
`planning/planner.py` and `planning/shape_memory.py` compute memory from.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from zeromem.config.leaf_modules import LeafModuleConfig
from zeromem.optim.muon import uses_muon
from zeromem.planning.shape_memory import ModelShape, UnmergedUnit, merged_unit_numels
from zeromem.stage3.units import UnitCaps, unmerged_units

_ALIASES = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "vocab": ("vocab_size", "n_vocab"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "positions": ("max_position_embeddings", "n_positions", "block_size", "max_seq_len", "n_ctx"),
}
_GATED_FAMILIES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
                   "olmo", "olmo2", "internlm2", "yi"}
_ROTARY_FAMILIES = _GATED_FAMILIES | {"gpt_neox", "gptj", "falcon", "phi"}


# ---------------------------------------------------------------- models on the meta device

@dataclass(frozen=True)
class Arch:
    """A GPT-family architecture read from a Hugging Face-style config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    positions: int
    learned_positions: bool  # a position table (GPT-2) rather than rotary embeddings
    gated: bool  # gate/up/down MLP with RMSNorm (Llama) rather than fc/proj with LayerNorm
    bias: bool
    tied: bool  # output head shares the token embedding


def arch_from_config(cfg: dict) -> Arch:
    """Read sizes and family from a config dict (GPT-2, Llama and look-alikes)."""
    dims = read_dims(cfg)
    missing = [k for k in ("layers", "hidden", "heads", "vocab") if k not in dims]
    if missing:
        raise ValueError(f"config lacks {', '.join(missing)} (looked for "
                         + "; ".join(f"{k}: {'/'.join(_ALIASES[k])}" for k in missing) + ")")
    family = str(cfg.get("model_type", "")).lower()
    gated = family in _GATED_FAMILIES or cfg.get("hidden_act") in ("silu", "swiglu")
    rotary = family in _ROTARY_FAMILIES or any(k in cfg for k in ("rope_theta", "rotary_dim",
                                                                  "rotary_pct", "rope_scaling"))
    hidden = dims["hidden"]
    return Arch(dims["layers"], hidden, dims["heads"],
                int(cfg.get("num_key_value_heads") or dims["heads"]), dims["vocab"],
                dims.get("intermediate", 4 * hidden), dims.get("positions", 2048), not rotary,
                gated, bool(cfg.get("attention_bias", not gated)),
                bool(cfg.get("tie_word_embeddings", not gated)))


class _Attention(nn.Module):
    def __init__(self, arch: Arch):
        super().__init__()
        h, kv = arch.hidden, arch.hidden // arch.heads * arch.kv_heads
        if arch.gated:  # Llama keeps q, k, v apart
            self.q = nn.Linear(h, h, bias=arch.bias)
            self.k = nn.Linear(h, kv, bias=arch.bias)
            self.v = nn.Linear(h, kv, bias=arch.bias)
        else:  # GPT-2's fused c_attn
            self.qkv = nn.Linear(h, h + 2 * kv, bias=arch.bias)
        self.proj = nn.Linear(h, h, bias=arch.bias)


class _MLP(nn.Module):
    def __init__(self, arch: Arch):
        super().__init__()
        h, inner = arch.hidden, arch.intermediate
        if arch.gated:
            self.gate = nn.Linear(h, inner, bias=False)
        self.fc = nn.Linear(h, inner, bias=not arch.gated)
        self.proj = nn.Linear(inner, h, bias=not arch.gated)


def _norm(arch: Arch) -> nn.Module:
    return nn.RMSNorm(arch.hidden) if arch.gated else nn.LayerNorm(arch.hidden)


class _Block(nn.Module):
    def __init__(self, arch: Arch):
        super().__init__()
        self.ln_attn, self.attn = _norm(arch), _Attention(arch)
        self.ln_mlp, self.mlp = _norm(arch), _MLP(arch)


class ConfigGPT(nn.Module):
    """A stand-in with the parameter shapes and module structure a config describes (no forward)."""

    def __init__(self, arch: Arch):
        super().__init__()
        self.arch = arch
        self.token_embedding = nn.Embedding(arch.vocab, arch.hidden)
        if arch.learned_positions:
            self.position_embedding = nn.Embedding(arch.positions, arch.hidden)
        self.blocks = nn.ModuleList(_Block(arch) for _ in range(arch.layers))
        self.ln_final = _norm(arch)
        self.head = nn.Linear(arch.hidden, arch.vocab, bias=False)
        if arch.tied:
            self.head.weight = self.token_embedding.weight


def _import_factory(spec: str):
    target, _, name = spec.rpartition(":")
    loaded = getattr(sys.modules.get(Path(target).stem), "__file__", None)
    if target.endswith(".py") and loaded and Path(loaded).resolve() == Path(target).resolve():
        # already imported: a second copy would make its classes unpicklable (spawned ranks)
        module = sys.modules[Path(target).stem]
    elif target.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(Path(target).stem, target)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"cannot import {target}: not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # dataclasses look their module up here
        module_spec.loader.exec_module(module)
    else:
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # a console script does not put "." on the path
        module = importlib.import_module(target)
    return getattr(module, name)


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _check_stand_in(spec: str, cfg: dict) -> None:
    """Refuse a config `ConfigGPT` cannot stand in for: it has one dense MLP a layer and no
    encoder, so it would count a fraction of an expert or encoder-decoder model."""
    kind = next((k for k in _EXPERT_KEYS if cfg.get(k)), None) or \
        ("is_encoder_decoder" if cfg.get("is_encoder_decoder") else None)
    if kind is not None:
        raise ValueError(f"{spec}: its {kind} describes a model the planner's dense stand-in "
                         f"cannot count; install transformers (which knows model_type "
                         f"{cfg.get('model_type')!r}) to plan it")


def load_model(spec: str) -> tuple[nn.Module, dict]:
    """(model built on the meta device, its config as a dict) from a factory path or a JSON file.

    `spec` is "package.module:function" (or "path/file.py:function"), called with no
    arguments, or the path of a Hugging Face-style config JSON (nothing is downloaded): the
    model transformers builds from it (`load_hf_model`), else, without transformers or for a
    model_type it does not know, the dense `ConfigGPT` stand-in.
    """
    if spec.endswith(".json"):
        cfg = json.loads(Path(spec).read_text(encoding="utf-8"))
        model = load_hf_model(cfg)
        if model is not None:
            return model, cfg
        _check_stand_in(spec, cfg)
        with torch.device("meta"):
            return ConfigGPT(arch_from_config(cfg)), cfg
    if ":" not in spec:
        raise ValueError(f"MODEL must be package.module:function or a config .json, got {spec!r}")
    with torch.device("meta"):
        model = _import_factory(spec)()
    return model, config_dict(getattr(model, "config", None))


_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                 "AutoModel")


def build_real(spec: str) -> nn.Module:
    """The model `spec` names (as `load_model` reads it) built for real on the CPU, randomly
    initialised: what `planning/calibrate.py` runs. A config JSON needs transformers."""
    if spec.endswith(".json"):
        model = load_hf_model(json.loads(Path(spec).read_text(encoding="utf-8")), "cpu")
        if model is None:
            raise ValueError(f"{spec}: transformers cannot build this config, so there is "
                             "nothing to run for --calibrate")
        return model
    return _import_factory(spec)()


def load_hf_model(cfg: dict, device: str = "meta") -> nn.Module | None:
    """The real Hugging Face model a config dict describes, on the meta device: the class its
    `architectures` names, else the first auto class that knows its `model_type`; None when
    transformers is not installed or knows neither (nothing is downloaded). Its forward is
    what `planning/activation_trace.py` traces."""
    try:
        import transformers
    except ImportError:
        return None
    kind = cfg.get("model_type")
    if not kind:
        return None
    try:
        config = transformers.AutoConfig.for_model(kind, **{k: v for k, v in cfg.items()
                                                           if k != "model_type"})
    except (ValueError, KeyError):
        return None
    named = [getattr(transformers, a) for a in cfg.get("architectures") or ()
             if isinstance(getattr(transformers, a, None), type)]
    if named:  # the head the config was saved with (a classifier's, say), as from_pretrained builds
        with torch.device(device):
            return named[0]._from_config(config)
    for name in _AUTO_CLASSES:
        try:
            with torch.device(device):
                return getattr(transformers, name).from_config(config)
        except ValueError:  # this auto class has no model for the config's type
            continue
    return None


def config_dict(config: object) -> dict:
    """A model's `config` attribute (dataclass, Hugging Face config, dict, object) as a dict."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(config) if isinstance(config, dict) else dict(getattr(config, "__dict__", {}))


def read_dims(cfg: dict) -> dict[str, int]:
    """Sizes found under any of their usual names (`_ALIASES`); absent ones are left out."""
    dims = {}
    for key, names in _ALIASES.items():
        # one size: a hierarchical vision model's per-stage lists (Swin's num_heads) are not
        value = next((cfg[n] for n in names if isinstance(cfg.get(n), (int, float, str))
                      and not isinstance(cfg[n], bool) and cfg[n]), None)
        if value is not None:
            dims[key] = int(value)
    if "intermediate" not in dims and cfg.get("mlp_ratio") and "hidden" in dims:
        dims["intermediate"] = int(cfg["mlp_ratio"] * dims["hidden"])
    return dims


def _token_embedding(model: nn.Module) -> nn.Embedding | None:
    """The embedding of the input tokens: a Hugging Face model names it, else the first one
    (not the largest: a character-level model's position table outnumbers its vocabulary)."""
    named = getattr(model, "get_input_embeddings", None)
    try:
        found = named() if callable(named) else None
    except NotImplementedError:  # a Hugging Face model without token inputs (ResNet)
        found = None
    if isinstance(found, nn.Embedding):
        return found
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _dims_from_modules(model: nn.Module) -> dict[str, int]:
    """Fallback sizes read off the modules: the token embedding and the longest ModuleList."""
    lists = [len(m) for m in model.modules() if isinstance(m, nn.ModuleList)]
    dims = {"layers": max(lists, default=1)}
    tokens = _token_embedding(model)
    if tokens is not None:
        dims["hidden"] = tokens.embedding_dim
        dims["vocab"] = tokens.num_embeddings
    return dims


def model_dims(model: nn.Module, cfg: dict | None = None) -> dict[str, int]:
    """`model`'s sizes: its config's (`read_dims`) where it names them, else its modules'."""
    return {**_dims_from_modules(model), **read_dims(cfg or {})}


def shape_of(model: nn.Module, cfg: dict | None = None, name: str = "",
             bucket_numel: int | None = None, leaves: Sequence[nn.Module] | None = None,
             **overrides: int | None) -> ModelShape:
    """The planner's view of `model`: parameter sizes, fetch units and dimensions.

    Dimensions come from `overrides`, then `cfg` (a model config), then the modules.
    `bucket_numel`: the run's reduce_bucket_size, which caps merged fetch units.
    `leaves`: the run's ZeRO-3 leaf modules, never split between units (by default those
    of `zero_optimization.leaf_module`'s defaults, DeepSpeed's MoE blocks).
    """
    if leaves is None:
        leaves = LeafModuleConfig().modules(model)
    dims = {**model_dims(model, cfg), **{k: v for k, v in overrides.items() if v}}
    hidden = dims.get("hidden") or 1
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    muon = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and uses_muon(n, p))
    frozen_params = [p for p in model.parameters() if not p.requires_grad]
    frozen = sum(p.numel() for p in frozen_params)
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen_params)
    order = {id(p): i for i, p in enumerate(model.parameters())}
    # the engine's default stage-3 units (stage3/units.py), in the engine's group order
    # (expected backward order), which decides how NVMe sub-groups cut; merged again under a
    # run's caps by `ModelShape.with_unit_caps`

    def units(trainable: bool) -> tuple[UnmergedUnit, ...]:
        """Frozen parameters get units of their own (stage3/units.py `choose_units`)."""
        plans = unmerged_units(model, sharded=lambda p: p.requires_grad == trainable,
                               leaves=leaves)
        return tuple(UnmergedUnit(min(order[id(p)] for p in u.params), u.numel, u.shared)
                     for u in plans)

    unmerged, frozen_unmerged = units(True), units(False)
    caps = UnitCaps(bucket_numel)  # reduce_bucket_size caps
    return ModelShape(name or type(model).__name__, tuple(trainable), frozen,
                      merged_unit_numels(unmerged, caps), dims.get("layers", 1), hidden,
                      dims.get("heads", max(1, hidden // 64)), dims.get("vocab", 0),
                      dims.get("intermediate", 4 * hidden), dims.get("positions"), unmerged,
                      merged_unit_numels(frozen_unmerged, caps), frozen_unmerged,
                      frozen_bytes / frozen if frozen else 4.0, muon, _idle_experts(model, cfg or {}))


_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k")


def _idle_experts(model: nn.Module, cfg: dict) -> int:
    """The trainable expert elements (under a module named `experts`; a shared expert is
    not one) a token skips: all but the config's top-k of its experts. 0 where the config
    does not say how many experts there are and how many a token takes."""
    count = next((int(cfg[k]) for k in _EXPERT_KEYS if cfg.get(k)), 0)
    top_k = next((int(cfg[k]) for k in _TOP_K_KEYS if cfg.get(k)), 0)
    if not count or not top_k or top_k >= count:
        return 0
    experts = sum(p.numel() for name, p in model.named_parameters()
                  if p.requires_grad and "experts" in name.split("."))
    return experts * (count - top_k) // count
