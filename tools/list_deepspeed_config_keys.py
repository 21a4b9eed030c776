"""Write tests/data/deepspeed_config_keys.json: every config key the installed DeepSpeed reads.

    DS_ACCELERATOR=cpu .venv-bench/bin/python tools/list_deepspeed_config_keys.py

Two sources, because DeepSpeed reads its config two ways:
- its pydantic blocks (`zero_optimization` with the offload and ZenFlow blocks, `fp16`,
  `bf16`, the monitors, `comms_logger`, `timers.throughput`, `compile`, `tensor_parallel`,
  `hybrid_engine`): every field, under its name and its alias, with its default;
- the rest (`get_scalar_param(param_dict, ...)` and friends in runtime/config.py): read
  off a config whose dicts record each key DeepSpeed looks up while `DeepSpeedConfig`
  parses it (the blocks given empty, so that their own keys are looked up too).

tests/unit/test_deepspeed_config_keys.py checks that zeromem's schema knows each of them
(reads, refuses by name or warns; never "unknown key"). Rerun when DeepSpeed changes.
"""
from __future__ import annotations

import enum
import json
import logging
import os
import typing
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
logging.disable(logging.WARNING)

import deepspeed  # noqa: E402
from deepspeed.comm.config import CommsLoggerConfig  # noqa: E402
from deepspeed.compile.config import CompileConfig  # noqa: E402
from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig, HybridEngineConfig  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: E402
from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402
from deepspeed.utils.config import DeepSpeedThroughputTimerConfig  # noqa: E402
from pydantic import BaseModel  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "deepspeed_config_keys.json"

BLOCKS = {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config,
          "bf16": DeepSpeedBF16Config, "tensorboard": TensorBoardConfig, "wandb": WandbConfig,
          "csv_monitor": CSVConfig, "comet": CometConfig, "comms_logger": CommsLoggerConfig,
          "timers.throughput": DeepSpeedThroughputTimerConfig, "compile": CompileConfig,
          "tensor_parallel": TPTrainingConfig, "hybrid_engine": HybridEngineConfig}

# given empty, so that DeepSpeedConfig looks up their keys too
LOOKED_INTO = ("fp16", "bf16", "activation_checkpointing", "aio", "flops_profiler",
               "checkpoint", "data_types", "torch_autocast", "comms_logger")


def as_json(value: object) -> object:
    """A default as a config file would hold it (None where JSON has no such value)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)  # DeepSpeed's pp_int prints with commas
    try:
        json.dumps(value)
        return value
    except TypeError:
        return None


def model_keys(model: type[BaseModel], prefix: str) -> dict[str, object]:
    """Dotted keys of `model`'s fields, nested blocks walked, under name and alias."""
    keys: dict[str, object] = {}
    for name, field in model.model_fields.items():
        inner = [c for c in (field.annotation, *typing.get_args(field.annotation))
                 if isinstance(c, type) and issubclass(c, BaseModel)]
        for spelling in {name, field.alias or name}:
            if inner:
                keys.update(model_keys(inner[0], f"{prefix}{spelling}."))
            else:
                keys[prefix + spelling] = as_json(field.get_default(call_default_factory=True))
    return keys


class Recording(dict):
    """A config dict that notes each key looked up in it (and in its nested dicts)."""

    def __init__(self, data: dict, seen: set[str], path: str = ""):
        super().__init__(data)
        self.seen, self.path = seen, path

    def _noted(self, key: object, value: object) -> object:
        self.seen.add(f"{self.path}{key}")
        if isinstance(value, dict) and not isinstance(value, Recording):
            return Recording(value, self.seen, f"{self.path}{key}.")
        return value

    def __getitem__(self, key):
        return self._noted(key, super().__getitem__(key))

    def get(self, key, default=None):
        return self._noted(key, super().get(key, default))

    def __contains__(self, key) -> bool:
        self.seen.add(f"{self.path}{key}")
        return super().__contains__(key)


def looked_up() -> set[str]:
    """Keys `DeepSpeedConfig` looks up in a config that has every block it parses by hand."""
    seen: set[str] = set()
    config = {"train_micro_batch_size_per_gpu": 1, **{block: {} for block in LOOKED_INTO},
              "optimizer": {"type": "Adam", "params": {}},
              "scheduler": {"type": "WarmupLR", "params": {}}}
    DeepSpeedConfig(Recording(config, seen))
    return seen


def main() -> None:
    keys: dict[str, object] = {}
    for prefix, model in BLOCKS.items():
        keys.update(model_keys(model, prefix + "."))
    blocks = {key.rsplit(".", 1)[0] for key in keys} | {k for k in LOOKED_INTO}
    for key in looked_up():
        parent = key.rsplit(".", 1)[0] if "." in key else None
        is_block = key in blocks or any(k.startswith(key + ".") for k in keys)
        if not is_block and (parent is None or parent in LOOKED_INTO or parent in blocks) \
                and key not in keys:
            keys[key] = None
    OUT.write_text(json.dumps({"deepspeed": deepspeed.__version__,
                               "written_by": "tools/list_deepspeed_config_keys.py",
                               "keys": dict(sorted(keys.items()))}, indent=1) + "\n")
    print(f"{len(keys)} keys of DeepSpeed {deepspeed.__version__} -> {OUT}")


if __name__ == "__main__":
    main()
