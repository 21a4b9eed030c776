"""Every config key DeepSpeed reads is one zeromem knows: read, refused by name, or warned
about; never "unknown key", "not a DeepSpeed key" or "did you mean". No process group.

The keys are DeepSpeed's own, listed from an installed DeepSpeed by
tools/list_deepspeed_config_keys.py into tests/data/deepspeed_config_keys.json (DeepSpeed is
a benchmark dependency, not a test one). Before stop 49 four keys of DeepSpeed 0.19.8 were
refused as unknown (SuperOffload's two, `compute_grad_norm`, `parameter_alignment`) and two
as "not a DeepSpeed key" (`disable_python_gc`, `vocabulary_size`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from zeromem.config.schema import Config, ConfigError
from zeromem.config.support import READ

LISTED = json.loads((Path(__file__).parent.parent / "data" / "deepspeed_config_keys.json").read_text())
KEYS: dict[str, object] = LISTED["keys"]
NOT_KNOWN = ("unknown key", "not a DeepSpeed", "did you mean")


def config_with(key: str, value: object) -> dict:
    """A minimal config holding `key` (dotted) at `value`; offload blocks get a device."""
    data: dict = {"train_micro_batch_size_per_gpu": 1}
    *parents, leaf = key.split(".")
    inner = data
    for name in parents:
        inner = inner.setdefault(name, {})
        if name in ("offload_optimizer", "offload_param"):
            inner.setdefault("device", "cpu")
    inner[leaf] = value
    return data


def test_the_list_is_deepspeeds_and_not_empty():
    assert LISTED["deepspeed"].startswith("0.") and len(KEYS) > 200
    # one of each source: a pydantic field (and its alias), a key read by hand, a nested block's
    for key in ("zero_optimization.stage3_param_persistence_threshold",
                "zero_optimization.param_persistence_threshold", "gradient_clipping",
                "aio.block_size", "zero_optimization.offload_optimizer.super_offload"):
        assert key in KEYS


@pytest.mark.parametrize("key", sorted(KEYS))
def test_deepspeeds_key_at_its_default_is_known(key, caplog):
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        try:
            Config.load(config_with(key, KEYS[key]), world_size=2)
            said = ""
        except ConfigError as error:  # refused by name, or a value zeromem checks
            said = str(error)
    said += "\n".join(r.getMessage() for r in caplog.records)
    assert not any(words in said for words in NOT_KNOWN), said


# Where zeromem's default is not DeepSpeed 0.19.8's, on purpose: NVMe read-ahead and
# write-behind on (issue 16: the optimizer step at the disk's pace)
OWN_DEFAULTS = {"zero_optimization.offload_optimizer.pipeline_read": True,
                "zero_optimization.offload_optimizer.pipeline_write": True}


def test_keys_zeromem_reads_default_to_deepspeeds_values():
    """Before stop 49 `offload_*.pin_memory` defaulted to false (DeepSpeed's default until
    0.19), and WarmupLR's `warmup_max_lr` (test_schedulers.py) to 0.001."""
    given = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                   "offload_param": {"device": "cpu"}}}  # the blocks exist
    defaults = Config.load(given)
    compared = 0
    for key in READ:
        if KEYS.get(key) is None or key.endswith((".stage", ".device")):
            continue  # read by hand in DeepSpeed (no default listed), or given above
        want = OWN_DEFAULTS.get(key, KEYS[key])
        assert defaults.value_at(key) == want, f"{key}: {defaults.value_at(key)!r}, DeepSpeed {want!r}"
        compared += 1
    assert compared > 40
