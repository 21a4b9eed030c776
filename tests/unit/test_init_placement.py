"""What `zeromem.Init` reads of a config: where parameters live, nothing else.

Hugging Face's `from_pretrained` calls `deepspeed.zero.Init` with the Trainer's DeepSpeed
config before the Trainer has filled its "auto" placeholders, so Init must not validate
the blocks it does not use (the engine validates the config whole later).
"""
import json
from pathlib import Path

import pytest

from zeromem.config.schema import ConfigError
from zeromem.stage3.partitioned_init import placement_config

HF_ZERO3 = Path(__file__).parent.parent / "data" / "hf_configs" / "ds_config_zero3.json"


def _hf_zero3(tmp_path: Path, offload_param: dict) -> Path:
    raw = json.loads(HF_ZERO3.read_text())
    raw["zero_optimization"]["offload_param"] = offload_param
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw))
    return path


def test_hf_config_with_auto_placeholders_gives_its_nvme_placement(tmp_path):
    path = _hf_zero3(tmp_path, {"device": "nvme", "nvme_path": str(tmp_path)})
    zero = placement_config(path).zero_optimization
    assert zero.offload_param_device == "nvme"
    assert zero.offload_param is not None and zero.offload_param.nvme_path == str(tmp_path)


def test_hf_config_with_cpu_placement_is_read_as_cpu(tmp_path):
    path = _hf_zero3(tmp_path, {"device": "cpu", "pin_memory": True})
    assert placement_config(path).zero_optimization.offload_param_device == "cpu"


def test_a_bad_placement_is_refused_naming_file_and_key(tmp_path):
    path = _hf_zero3(tmp_path, {"device": "nvme"})  # nvme without nvme_path
    with pytest.raises(ConfigError, match=r"ds_config\.json.*nvme_path"):
        placement_config(path)
