"""`zeromem accelerate-launch` runs `accelerate launch` with zeromem as its DeepSpeed.

The job is started as TRL's and Accelerate's recipes start it: an Accelerate config
file whose `distributed_type: DEEPSPEED` block (modelled on TRL's
examples/accelerate_configs/deepspeed_zero3.yaml) chooses ZeRO-3, and a script with
no DeepSpeed in it. Its losses must equal one process's on the same global batch, and
so must those of a run resumed from its `accelerator.save_state`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("accelerate_launch_script.py")
pytest.importorskip("accelerate")
CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_multinode_launcher: standard
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


def test_accelerate_config_runs_zero3_on_zeromem(tmp_path):
    config = tmp_path / "deepspeed_zero3.yaml"
    config.write_text(CONFIG)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = subprocess.run(
        [sys.executable, "-m", "zeromem.cli", "accelerate-launch", "--config_file", str(config),
         "--main_process_port", "0", str(SCRIPT), "zeromem", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=240)
    assert launch.returncode == 0, launch.stderr[-6000:]
    ours = json.loads((tmp_path / "zeromem.json").read_text())
    subprocess.run([sys.executable, str(SCRIPT), "reference", str(tmp_path), str(ours["clip"])],
                   env=env, check=True, timeout=120)
    reference = json.loads((tmp_path / "reference.json").read_text())
    assert (ours["engine"], ours["stage"], ours["ranks"], ours["clip"]) == (
        "zeromem.deepspeed.engine", 3, 2, 1.0)
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-7)
    # `accelerator.save_state` / `load_state` (DeepSpeed's save_checkpoint / load_checkpoint
    # under the tag "pytorch_model"): the momentum and the model come back
    assert ours["resumed"] == pytest.approx(reference["losses"][3:], rel=1e-5, abs=1e-7)
    assert sorted(os.listdir(tmp_path / "state"))[:2] == ["latest", "pytorch_model"]
