"""The rules `zeromem.config.schema` applies around its pydantic blocks (REFERENCE.md section 2).

Kept apart from the block models so each can be read alone; nothing here imports
`zeromem.config.schema`, which re-exports the public names (`ConfigError`, `resolve_batch`).

- error messages: turning a pydantic `ValidationError` into one `ConfigError` message that
  names the dotted key, with "did you mean ...?" for unknown keys;
- key aliases and legacy renames: the renaming tables of the blocks, the generic rename
  step every block runs before validation, and DeepSpeed's deprecated `cpu_offload*` keys;
- "auto" values: the Hugging Face placeholder, resolved where it can be derived (the batch
  keys, the hidden-size keys), zeromem's default for other ZeRO sizes and placements, and
  refused where a default would change what is trained;
- the batch triple: train = micro x gas x world_size, by DeepSpeed's rules.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any, Callable, get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

logger = logging.getLogger("zeromem")


class ConfigError(ValueError):
    """An invalid config; the message names the offending key by its dotted path."""

    __module__ = "zeromem.config.schema"  # its public home, which re-exports it


class Unsupported(ConfigError):
    """A DeepSpeed feature or setting the config turns on that zeromem does not run.

    `key` is the dotted key that turns it on, `feature` DeepSpeed's name for it (None when
    the key is the whole feature) and `reason` why zeromem refuses it and what to use
    instead; the message says all of them.
    """

    __module__ = "zeromem.config.schema"

    def __init__(self, key: str, feature: str | None, reason: str, value: Any = None,
                 message: str | None = None):
        self.key, self.feature, self.reason, self.value = key, feature, reason, value
        shown = f" = {value!r}" if value is not None else ""
        named = f" ({feature})" if feature else ""
        super().__init__(message or f"{key}{shown} is not supported{named}: {reason}")

    def __reduce__(self):  # pickles (spawned ranks) with its fields, origin prefix included
        return (type(self), (self.key, self.feature, self.reason, self.value, str(self)))


# ---------------------------------------------------------------- error messages

# An unknown top-level key with no close match: DeepSpeed would ignore it, zeromem does not.
NOT_DEEPSPEED = ("it is not a DeepSpeed or zeromem key (DeepSpeed ignores unknown top-level "
                 "keys; zeromem refuses them so that a typo is not ignored silently: to drop them "
                 'with a warning, set "zeromem": {"ignore_unknown_keys": true})')


def unknown_key_message(key: str, path: str, valid: list[str], otherwise: str | None = None) -> str:
    """`key` at dotted `path` is not one of `valid`: suggest the closest, else say `otherwise`
    (by default: list them)."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]!r}?" if close
            else otherwise or "valid keys: " + ", ".join(sorted(valid)))
    return f"unknown key {key!r} at {path}; {hint}"


def _block_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class found by following field names `loc` down from `root`."""
    block: type[BaseModel] | None = root
    for name in loc:
        field = block.model_fields.get(name) if block else None
        if field is None:
            return None
        candidates = (field.annotation, *get_args(field.annotation))
        block = next((c for c in candidates
                      if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return block


_MUST_BE = {
    "literal_error": "one of {expected}", "int_type": "an integer", "int_parsing": "an integer",
    "int_from_float": "a whole number", "float_type": "a number", "float_parsing": "a number",
    "bool_type": "true or false", "bool_parsing": "true or false", "string_type": "a string",
    "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
    "greater_than_equal": ">= {ge}", "greater_than": "> {gt}",
    "less_than_equal": "<= {le}", "less_than": "< {lt}",
    "finite_number": "a finite number", "number_too_large": "at most 2**63 - 1 in magnitude",
    "pair_type": "a pair [first, second]",
}


def _describe_error(err: ErrorDetails, root: type[BaseModel], prefix: tuple = ()) -> str:
    loc = (*prefix, *err["loc"])
    path = ".".join(str(part) for part in loc)
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        block = _block_at(root, err["loc"][:-1])
        # `_also_known`: keys the block accepts before validation (config/features.py)
        valid = [*block.model_fields, *getattr(block, "_also_known", ())] if block else []
        top = len(loc) == 1 and block is root
        return unknown_key_message(str(loc[-1]), path, valid, NOT_DEEPSPEED if top else None)
    if kind == "missing":
        return f"{path} is required"
    if kind == "value_error":
        error = ctx["error"]
        return str(error) if isinstance(error, ConfigError) or not path else f"{path}: {error}"
    if kind in _MUST_BE:
        ctx = {k: str(v).replace(" or ", ", ") for k, v in ctx.items()}
        return f"{path} must be {_MUST_BE[kind].format(**ctx)}, got {_shown(err['input'])}"
    return f"{path}: {err['msg']} (got {_shown(err.get('input'))})"


def _shown(value: Any) -> str:
    """repr of a bad value, cut short: a 400-digit number should not drown the message."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def humanise(error: ValidationError, root: type[BaseModel], prefix: tuple = ()) -> str:
    """One message for all of `error`'s problems, keys dotted from `root` (after `prefix`)."""
    lines = list(dict.fromkeys(_describe_error(e, root, prefix) for e in error.errors()))
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} problems in the config:\n  - " + "\n  - ".join(lines)


# ---------------------------------------------------------------- key aliases and renames

# Stage-3 keys that DeepSpeed also accepts without the "stage3_" prefix.
_STAGE3_SHORT = ("prefetch_bucket_size", "param_persistence_threshold",
                 "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
                 "gather_16bit_weights_on_model_save", "module_granularity_threshold",
                 "use_all_reduce_for_fetch_params")

# Renaming tables, legacy key -> (current key, deprecated?), one per block that has any.
ZERO_RENAMED: dict[str, tuple[str, bool]] = {
    **{short: (f"stage3_{short}", False) for short in _STAGE3_SHORT},
    "stage3_gather_fp16_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", True)}
# DeepSpeed renamed thread_count (PR #7056) and now silently ignores the old name.
AIO_RENAMED: dict[str, tuple[str, bool]] = {"thread_count": ("intra_op_parallelism", True)}
TOP_LEVEL_RENAMED: dict[str, tuple[str, bool]] = {"bfloat16": ("bf16", False)}


def map_renamed_keys(data: Any, renamed: dict[str, tuple[str, bool]], section: str) -> Any:
    """`data` with the legacy keys of `renamed` under their current names (warning if deprecated).

    `section` is the block's dotted path, for the warning. Giving both names is an error.
    """
    if not isinstance(data, dict) or not renamed.keys() & data.keys():
        return data
    data = dict(data)
    for old, (new, deprecated) in renamed.items():
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"{old!r} and {new!r} name the same setting; give only {new!r}")
        if deprecated:
            where = f"{section}." if section else ""
            logger.warning("config key %s%s is deprecated; use %s%s", where, old, where, new)
        data[new] = data.pop(old)
    return data


def map_cpu_offload(data: Any) -> Any:
    """Map DeepSpeed's deprecated boolean offload keys onto the offload blocks."""
    legacy = ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")
    if not isinstance(data, dict) or not any(key in data for key in legacy):
        return data
    data = dict(data)
    pin = data.pop("cpu_offload_use_pin_memory", None)
    mapped = False
    for old, new in (("cpu_offload", "offload_optimizer"),
                     ("cpu_offload_param", "offload_param")):
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"{old!r} (deprecated) and {new!r} cannot both be given; "
                             f"keep {new!r}")
        value = data.pop(old)
        if not isinstance(value, bool):
            raise ValueError(f"{old} must be true or false, got {value!r}")
        logger.warning("config key zero_optimization.%s is deprecated; use %s.device", old, new)
        if value:
            data[new] = {"device": "cpu", "pin_memory": bool(pin)}
            mapped = True
    if pin is not None and not mapped:
        raise ValueError("cpu_offload_use_pin_memory only applies with cpu_offload or "
                         "cpu_offload_param; set offload_*.pin_memory instead")
    return data


# ---------------------------------------------------------------- "auto" values

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# zero_optimization keys whose "auto" HF Transformers derives from the model's hidden size
_AUTO_FROM_HIDDEN: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def _canonical_zero_key(key: str) -> str:
    return ZERO_RENAMED.get(key, (key,))[0]


def resolve_auto(data: dict, hidden_size: int | None, path: str = "") -> tuple[dict, list[str]]:
    """Copy of `data` with every "auto" resolved; also the dotted paths that were derived.

    Batch keys are dropped (the batch rules derive them); hidden-size keys are computed
    when the hidden size is known; other `zero_optimization` keys (sizes, placements) are
    dropped, so zeromem's defaults apply, as DeepSpeed's do. Anything else (the stage,
    precision, clipping, optimizer and scheduler values) changes what is trained, and there
    a silent default would surprise: an error.
    """
    resolved: dict[str, object] = {}
    derived: list[str] = []
    for key, value in data.items():
        dotted = f"{path}{key}"
        if isinstance(value, dict):
            resolved[key], inner = resolve_auto(value, hidden_size, f"{dotted}.")
            derived += inner
        elif not (isinstance(value, str) and value == "auto"):
            resolved[key] = value
        elif dotted in BATCH_KEYS:
            derived.append(dotted)
        elif (path == "zero_optimization." and hidden_size is not None
              and _canonical_zero_key(key) in _AUTO_FROM_HIDDEN):
            canonical = _canonical_zero_key(key)
            resolved[key] = _AUTO_FROM_HIDDEN[canonical](hidden_size)
            derived.append(path + canonical)
        elif dotted.startswith("zero_optimization.") and dotted != "zero_optimization.stage":
            # a sizing or placement choice: zeromem's own default, where DeepSpeed takes its
            # own (OpenRLHF writes "auto" for several and hands the config straight to
            # deepspeed.initialize, which drops them)
            logger.info('%s is "auto": zeromem\'s default', dotted)
        elif dotted == "gradient_clipping":
            raise ConfigError('gradient_clipping is "auto", which HF Transformers fills from '
                              "TrainingArguments.max_grad_norm; zeromem has no such source, "
                              "so give a number (0.0 turns clipping off)")
        else:
            raise ConfigError(f'{dotted} is "auto", a Hugging Face placeholder zeromem cannot '
                              "fill (only the batch keys and zero_optimization's sizes and "
                              "placements can be); give an explicit value")
    return resolved, derived


def resolve_batch(train: int | None, micro: int | None, gas: int | None,
                  world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro, gradient_accumulation_steps) by DeepSpeed's rules, in order."""

    def exact(divisor_text: str, divisor: int) -> int:
        assert train is not None  # only called when train_batch_size is given
        if train % divisor:
            raise ConfigError(f"train_batch_size ({train}) is not divisible by {divisor_text} "
                              f"= {divisor}; DeepSpeed would floor to {train // divisor} and "
                              "then fail")
        return train // divisor

    if train and micro and gas:
        pass
    elif train and micro:
        gas = exact(f"train_micro_batch_size_per_gpu × world_size = {micro} × {world_size}",
                    micro * world_size)
    elif train and gas:
        micro = exact(f"world_size × gradient_accumulation_steps = {world_size} × {gas}",
                      world_size * gas)
    elif micro and gas:
        train = micro * gas * world_size
    elif train:
        gas, micro = 1, exact(f"world_size = {world_size}", world_size)
    elif micro:
        gas, train = 1, micro * world_size
    else:
        raise ConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be "
                          'provided (as a number: "auto" batch keys are derived from the others)')
    if train != micro * gas * world_size:
        raise ConfigError(
            f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu × "
            f"gradient_accumulation_steps × world_size = {micro} × {gas} × {world_size} = "
            f"{micro * gas * world_size}")
    return train, micro, gas

