"""Pure-logic tests of zeromem.config.support: every schema key is read, refused, warned
about or gated, and DeepSpeed keys zeromem handles its own way say so. No process group.
(The schema's own validation is test_config.py's.)"""

from __future__ import annotations

import logging
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

import zeromem
from zeromem.config import schema as config_module
from zeromem.config import support
from zeromem.config.schema import Config, ConfigError


# ---------------------------------------------------------------- keys zeromem handles its own way

def test_numerics_changing_knobs_are_refused_and_layout_knobs_warned(caplog):
    with pytest.raises(ConfigError, match="gradient_predivide_factor"):
        support.check_supported_keys(Config.load({"gradient_predivide_factor": 2.0}))
    support.check_supported_keys(Config.load({"prescale_gradients": True}))  # what zeromem always does
    with pytest.raises(ConfigError, match="zero_optimization.reduce_scatter"):
        support.check_supported_keys(Config.load({"zero_optimization": {"stage": 2,
                                                                         "reduce_scatter": False}}))
    with caplog.at_level("WARNING", logger="zeromem"):
        support.check_supported_keys(Config.load({"zero_optimization": {"contiguous_gradients": False}}))
    assert "contiguous_gradients" in caplog.text
    support.check_supported_keys(Config.load({}))  # defaults: silent


# ---------------------------------------------------------------- every key accounted for

def schema_keys(block: type = Config, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field of the schema, walking the pydantic model tree."""
    keys = []
    for name, field in block.model_fields.items():
        inner = [c for c in (field.annotation, *typing.get_args(field.annotation))
                 if isinstance(c, type) and issubclass(c, BaseModel)]
        keys += schema_keys(inner[0], f"{prefix}{name}.") if inner else [prefix + name]
    return keys


def default_of(key: str):
    """The schema default of the leaf at dotted `key`."""
    *parents, leaf = key.split(".")
    block = Config
    for name in parents:
        field = block.model_fields[name]
        block = next(c for c in (field.annotation, *typing.get_args(field.annotation))
                     if isinstance(c, type) and issubclass(c, BaseModel))
    return block.model_fields[leaf].get_default(call_default_factory=True)


def put(data: dict, key: str, value) -> dict:
    """`data` with `value` at dotted `key`, creating the blocks on the way."""
    *parents, leaf = key.split(".")
    inner = data
    for name in parents:
        inner = inner.setdefault(name, {})
    inner[leaf] = value
    return data


# Non-default values for the keys that are not booleans.
SAMPLES = {"gradient_predivide_factor": 2.0, "communication_data_type": "fp16",
           "zero_optimization.stage3_model_persistence_threshold": 10,
           "zero_optimization.stage3_module_granularity_threshold": 10,
           "zero_optimization.offload_param.max_in_cpu": 10,
           "zero_optimization.zero_hpz_partition_size": 2,
           "zero_optimization.zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
           "zero_optimization.mics_shard_size": 2,
           "torch_autocast.lower_precision_safe_modules": ["torch.nn.modules.linear.Linear"]}


def non_default_config(key: str) -> dict:
    """A config dict setting `key` away from its default (a flipped bool or a sample value)."""
    data = put({}, key, SAMPLES[key] if key in SAMPLES else not default_of(key))
    if key == "zero_optimization.reduce_scatter":
        data["zero_optimization"]["stage"] = 2  # stage 0 all-reduces: nothing to refuse
    return data


def test_every_schema_key_is_read_refused_warned_or_gated():
    lists = {"READ": support.READ, "REFUSED": support.REFUSED, "WARNED": support.WARNED,
             "GATED": support.GATED}
    keys = schema_keys()
    for key in keys:
        named = [name for name, listed in lists.items() if key in listed]
        assert len(named) == 1, f"{key} must be in exactly one of READ/REFUSED/WARNED/GATED " \
                                f"(nothing may accept a key and ignore it), found in {named}"
    stale = [k for listed in lists.values() for k in listed if k not in keys]
    assert not stale, f"lists name keys the schema no longer has: {stale}"
    source = Path(zeromem.__file__).parent
    for key, modules in support.READ.items():
        leaf = key.rsplit(".", 1)[-1]
        uses = re.compile(rf"\.{leaf}\b|[\"']{leaf}[\"']")
        for module in modules:
            text = (source / f"{module.replace('.', '/')}.py").read_text()
            assert uses.search(text), f"{module}.py never reads {key}"
    for key, feature in support.GATED.items():
        assert feature in config_module.OUT_OF_SCOPE | config_module.NOT_BUILT, key


def test_refused_keys_raise_naming_the_key_and_why():
    for key, why in support.REFUSED.items():
        config = Config.load(non_default_config(key))
        with pytest.raises(ConfigError) as info:
            support.check_supported_keys(config)
        assert f"{key} = " in str(info.value) and why in str(info.value)


def test_warned_keys_warn_once_naming_the_key(caplog):
    for key, why in support.WARNED.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zeromem"):
            support.check_supported_keys(Config.load(non_default_config(key)))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and key in warnings[0] and why in warnings[0], (key, warnings)


def test_gated_keys_are_refused_at_load():
    for key in support.GATED:
        with pytest.raises(ConfigError) as info:
            Config.load(non_default_config(key))
        assert key in str(info.value) and "not supported" in str(info.value)


def test_default_values_are_silent_even_when_given(caplog):
    data: dict = {}
    for key in [*support.REFUSED, *support.WARNED, *support.GATED]:  # each spelled out at its default
        put(data, key, default_of(key))
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        support.check_supported_keys(Config.load(data))
    assert not caplog.records
