"""Schema fuzz of zeromem.config.schema: every wrong value is a ConfigError naming its dotted key.

For every field of the schema (leaves and blocks, the optimizer's and the schedules'
keywords included) the cases are generated from its annotation: booleans where a number
is expected, strings for numbers, lists, objects, null where not allowed, huge and
non-finite numbers, values past the bounds. None may load, and none may escape as
another exception (a traceback in the user's face). Pure logic, no process group.
"""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any, Literal

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from zeromem.optim import schedulers
from zeromem.config.schema import (Config, ConfigError, OptimizerConfig, _optimizer_params_model,
                            _scheduler_params_model)

HUGE = 10**400
# Values the fuzz would call wrong that a key takes on purpose: Infinity is "never print"
# (what HF Accelerate passes), and otherwise steps_per_print is a positive whole number.
VALID = {"steps_per_print": [math.inf], "torch_autocast.lower_precision_safe_modules": [None],
         # one name given bare is a list of one, as DeepSpeed reads it
         **{f"zero_optimization.leaf_module.{key}": ["0.9"]
            for key in ("classes", "names", "name_suffixes")}}
# Blocks whose leaves only validate next to a required sibling.
CONTEXT = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}}


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without Optional and Annotated, whether None is allowed)."""
    args = typing.get_args(annotation)
    nullable = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        nullable = type(None) in args
        annotation = next(a for a in args if a is not type(None))
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation, nullable


def _bound_breakers(field: FieldInfo, step: float) -> list:
    """Values just past the field's ge/gt/le/lt bounds."""
    out = []
    for rule in field.metadata:
        for name, past in (("ge", -step), ("gt", 0), ("le", step), ("lt", 0)):
            limit = getattr(rule, name, None)
            if limit is not None:
                out.append(limit + past)
    return out


def wrong_values(field: FieldInfo) -> list:
    """Values of the wrong type or out of range for `field`."""
    base, nullable = _unwrap(field.annotation)
    objects = [[1], {"a": 1}] + ([] if nullable else [None])
    if base is bool:
        return [1, 0, 1.0, "true", "yes", *objects]
    if base is int:
        return [True, "8", 1.5, HUGE, -HUGE, math.nan, math.inf, *objects,
                *_bound_breakers(field, 1)]
    if base is float:
        return [True, "0.5", HUGE, math.nan, math.inf, -math.inf, *objects,
                *_bound_breakers(field, 0.5)]
    if typing.get_origin(base) is Literal:
        return [True, "not-a-choice", 99, *objects]
    if base is str:
        return [1, True, *objects]
    if typing.get_origin(base) is list:  # Adam's betas
        return [0.9, "0.9", [0.9], [0.9, 0.99, 0.999], [True, 0.9], [0.9, 1.0], [-0.1, 0.9],
                [0.9, math.nan], {"a": 1}, None]
    if base is dict or typing.get_origin(base) is dict:
        return [1, "x", [1], True] + ([] if nullable else [None])
    if isinstance(base, type) and issubclass(base, BaseModel):
        return [1, "x", [1], True] + ([] if nullable else [None])
    raise AssertionError(f"no fuzz values for annotation {field.annotation!r}")


def schema_fields(block: type[BaseModel] = Config, prefix: str = ""):
    """(dotted key, FieldInfo) of every field, blocks included, walking the model tree."""
    for name, field in block.model_fields.items():
        yield prefix + name, field
        base, _ = _unwrap(field.annotation)
        if isinstance(base, type) and issubclass(base, BaseModel):
            yield from schema_fields(base, f"{prefix}{name}.")


def keyword_fields():
    """(dotted key, FieldInfo, context) of the optimizer's and the schedules' keywords."""
    for name, cls in OptimizerConfig._classes.items():
        model = _optimizer_params_model(cls)
        for arg, field in model.model_fields.items():
            if field.annotation is not Any:  # a keyword with no rule of ours: torch checks it
                yield f"optimizer.params.{arg}", field, {"optimizer": {"type": name}}
    for name in schedulers.SCHEDULERS:
        model = _scheduler_params_model(name)
        required = {a: 10 for a, f in model.model_fields.items() if f.is_required()}
        for arg, field in model.model_fields.items():
            yield f"scheduler.params.{arg}", field, {"scheduler": {"type": name,
                                                                   "params": dict(required)}}


def fuzz_cases() -> list[tuple[str, dict]]:
    cases = []
    for key, field in schema_fields():
        top = key.split(".")[0]
        for value in wrong_values(field):
            if value in VALID.get(key, []):
                continue
            data: dict = {top: dict(CONTEXT[top])} if top in CONTEXT and "." in key else {}
            inner = data
            *parents, leaf = key.split(".")
            for name in parents:
                inner = inner.setdefault(name, {})
            inner[leaf] = value
            cases.append((key, data))
    for key, field, context in keyword_fields():
        for value in wrong_values(field):
            block, _, arg = key.split(".")
            params = {**context[block].get("params", {}), arg: value}
            data = {block: {**context[block], "params": params}}
            cases.append((key, data))
    return cases


def test_every_wrong_value_is_a_config_error_naming_the_key():
    cases = fuzz_cases()
    escaped, silent, unnamed = [], [], []
    for key, data in cases:
        try:
            Config.load(data)
        except ConfigError as error:
            if key not in str(error):
                unnamed.append((key, data, str(error)))
        except Exception as error:  # noqa: BLE001 - any other exception is the bug we hunt
            escaped.append((key, data, repr(error)))
        else:
            silent.append((key, data))
    assert len(cases) > 700  # every field fuzzed, not a handful
    assert not escaped, f"{len(escaped)} of {len(cases)} escaped as tracebacks: {escaped[:5]}"
    assert not silent, f"{len(silent)} of {len(cases)} loaded silently: {silent[:5]}"
    assert not unnamed, f"{len(unnamed)} of {len(cases)} did not name the key: {unnamed[:5]}"


@pytest.mark.parametrize("text, key", [
    ('{"zero_optimization": {"stage": 3, "stage": 1}}', "zero_optimization.stage"),
    ('{"train_batch_size": 8, "train_batch_size": 8}', "train_batch_size"),
    ('{"optimizer": {"type": "SGD", "params": {"lr": 0.1, "lr": 0.2}}}', "optimizer.params.lr"),
])
def test_duplicate_keys_are_refused_in_text_and_files(tmp_path, text, key):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    for source in (text, path):
        with pytest.raises(ConfigError, match=f"{key} is given more than once"):
            Config.load(source)


@pytest.mark.parametrize("data, message", [
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage must be an integer"),
    ({"train_micro_batch_size_per_gpu": HUGE}, "train_micro_batch_size_per_gpu must be at most"),
    ({"fp16": {"initial_scale_power": 5000}}, "fp16.initial_scale_power must be <= 127"),
    ({"gradient_clipping": math.inf}, "gradient_clipping must be a finite number"),
    ({"steps_per_print": -math.inf}, "steps_per_print must be a finite number"),
    ({"steps_per_print": 2.5}, "steps_per_print must be a whole number"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}},
     "scheduler.params.warmup_num_steps must be >= 0"),
    ({"optimizer": {"type": "SGD", "params": {"lr": "0.01"}}}, "optimizer.params.lr must be a"),
    ({"optimizer": {"type": "SGD", "params": {"lr": -1}}}, "optimizer.params.lr must be >= 0"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
     "optimizer.params.betas must be a pair"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}},
     "optimizer.params.betas.1 must be < 1"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 0}}}, "optimizer.params.eps must be > 0"),
    ({"optimizer": {"type": "SGD", "params": {"momentum": -0.9}}},
     "optimizer.params.momentum must be >= 0"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}},
     "optimizer.params.weight_decay must be >= 0"),
])
def test_the_reported_holes_are_closed(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config.load(data)


def test_deepspeed_spellings_still_load():
    config = Config.load('{"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}, '
                         '"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, '
                         '"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, '
                         '"betas": [0.9, 0.999], "eps": 1e-8}}}', world_size=2)
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert config.train_batch_size == 4
    assert config.optimizer.params["betas"] == [0.9, 0.999]
    assert Config.load({"zero_optimization": {"reduce_bucket_size": "auto"}},
                       hidden_size=8).zero_optimization.reduce_bucket_size == 64
