"""`install_as_deepspeed()` beside a real DeepSpeed installation (users coming from DeepSpeed
have one): HF must see zeromem's surface, its module and its version, not the real package's.

Each case runs in a fresh interpreter (the switch changes `sys.modules` and
`sys.meta_path` for the whole process). The "installed DeepSpeed" is a real package
folder with its `.dist-info` on `sys.path`, as pip leaves them.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import zeromem.deepspeed

INSTALLED_VERSION = "0.19.8"


def installed_deepspeed(root: Path) -> Path:
    """A site folder holding a `deepspeed` package and its distribution metadata."""
    (root / "deepspeed").mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    info = root / f"deepspeed-{INSTALLED_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\n"
                                   f"Version: {INSTALLED_VERSION}\n")
    return root


def run(site: Path, code: str) -> str:
    path = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(site)])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path), timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_installed_deepspeed_neither_imports_nor_answers_for_the_surface(tmp_path):
    site = installed_deepspeed(tmp_path)
    assert run(site, "import importlib.metadata as m; print(m.version('deepspeed'))") \
        == INSTALLED_VERSION  # the folder is seen: without the switch, HF would find it
    seen = run(site, """
import importlib.metadata, importlib.util
import zeromem.deepspeed
zeromem.deepspeed.install_as_deepspeed()
import deepspeed
print(importlib.metadata.version("deepspeed"), hasattr(deepspeed, "REAL"),
      deepspeed is zeromem.deepspeed, importlib.util.find_spec("deepspeed") is not None)
""")
    assert seen == f"{zeromem.deepspeed.__version__} False True True"


def test_a_real_deepspeed_imported_first_is_named_in_the_refusal(tmp_path):
    site = installed_deepspeed(tmp_path)
    message = run(site, """
import deepspeed
import zeromem.deepspeed
try:
    zeromem.deepspeed.install_as_deepspeed()
except RuntimeError as e:
    print(e)
""")
    assert "a 'deepspeed' module" in message and str(site / "deepspeed") in message, message


def test_the_submodules_scripts_import_are_zeromems_own(tmp_path):
    """`from deepspeed.ops.adam import DeepSpeedCPUAdam` (Accelerate, for an offloaded
    optimizer) and the rest give zeromem's module objects, not second copies of them."""
    seen = run(tmp_path, """
import zeromem.deepspeed
zeromem.deepspeed.install_as_deepspeed()
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.lion import DeepSpeedCPULion
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold
from deepspeed.utils import safe_get_full_grad, set_z3_leaf_modules
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from deepspeed.runtime.utils import see_memory_usage
from deepspeed.utils.zero_to_fp32 import get_optim_files, get_model_state_file
from deepspeed.utils.logging import logger, log_dist
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.compression.helper import recursive_getattr, recursive_setattr  # DeepSpeed-Chat
from deepspeed.utils.module_utils import recursive_getattr as getattr_now  # its new home
from deepspeed import get_accelerator  # DeepSpeed-Chat's main.py
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum  # OpenRLHF
from deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec  # Megatron-DeepSpeed
from deepspeed.runtime.pipe.engine import PipelineEngine
import deepspeed
import zeromem.deepspeed.estimators, zeromem.deepspeed.runtime_utils, zeromem.deepspeed.utils.zero_to_fp32
import zeromem.deepspeed.utils.logging, zeromem.deepspeed.checkpointing
import zeromem.deepspeed.utils.module_utils, zeromem.deepspeed.accelerator
import zeromem.ds_attributes
import sys
import torch
own = {name: sys.modules[f"zeromem.deepspeed.ops.{name}"] for name in ("adam", "adagrad", "lion")}
print(DeepSpeedCPUAdam is own["adam"].DeepSpeedCPUAdam, FusedAdam is own["adam"].FusedAdam,
      DeepSpeedCPUAdagrad is own["adagrad"].DeepSpeedCPUAdagrad,
      DeepSpeedCPULion is own["lion"].DeepSpeedCPULion,
      ZeroParamStatus is zeromem.ds_attributes.ZeroParamStatus,
      estimate_zero3_model_states_mem_needs_all_live is
      zeromem.deepspeed.estimators.estimate_zero3_model_states_mem_needs_all_live,
      estimate_zero2_model_states_mem_needs_all_cold is
      zeromem.deepspeed.estimators.estimate_zero2_model_states_mem_needs_all_cold,
      safe_get_full_grad is zeromem.deepspeed.utils.safe_get_full_grad,
      set_z3_leaf_modules is zeromem.deepspeed.utils.set_z3_leaf_modules,
      get_fp32_state_dict_from_zero_checkpoint is
      zeromem.deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint,
      see_memory_usage is zeromem.deepspeed.runtime_utils.see_memory_usage,
      get_model_state_file is zeromem.deepspeed.utils.zero_to_fp32.get_model_state_file,
      logger is zeromem.deepspeed.utils.logging.logger is deepspeed.utils.logging.logger,
      log_dist is zeromem.deepspeed.utils.log_dist,
      deepspeed.checkpointing is zeromem.deepspeed.checkpointing,
      isinstance(DeepSpeedOptimizer, type),
      recursive_getattr is getattr_now is zeromem.deepspeed.utils.module_utils.recursive_getattr,
      recursive_setattr is zeromem.deepspeed.utils.module_utils.recursive_setattr,
      get_accelerator is zeromem.deepspeed.accelerator.get_accelerator,
      OffloadStateTypeEnum.optim_states == "optim_states" and OffloadDeviceEnum.cpu == "cpu",
      PipelineEngine is deepspeed.PipelineEngine is zeromem.deepspeed.pipe.PipelineEngine,
      issubclass(TiedLayerSpec, LayerSpec) and issubclass(PipelineModule, torch.nn.Module))
""")
    assert seen == " ".join(["True"] * 22)


def test_see_memory_usage_logs_when_forced(caplog):
    """DeepSpeed's `see_memory_usage(message, force)`: silent unless forced, then the
    message with the accelerator's memory and this process's resident host memory."""
    import logging

    from zeromem.deepspeed.runtime_utils import host_resident_bytes, see_memory_usage
    with caplog.at_level(logging.INFO, logger="zeromem.deepspeed"):
        see_memory_usage("quiet")
        see_memory_usage("after initialize", force=True)
    assert "quiet" not in caplog.text and "after initialize" in caplog.text
    assert "host resident" in caplog.text and host_resident_bytes() > 10 * 2 ** 20


def test_recursive_attributes_reach_submodules_by_dotted_name():
    """DeepSpeed-Chat's LoRA swap: `recursive_setattr(model, 'decoder.layers.0.fc1', lora)`."""
    from torch import nn

    from zeromem.deepspeed.utils.module_utils import recursive_getattr, recursive_setattr
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert recursive_getattr(model, "0.1") is model[0][1]
    new = nn.Linear(2, 2)
    recursive_setattr(model, "0.0", new)
    assert model[0][0] is new
    recursive_setattr(model, "extra", new)
    assert model.extra is new


def test_building_a_pipeline_is_refused_by_name():
    """Megatron-DeepSpeed subclasses `deepspeed.pipe.PipelineModule` at import and asks
    `isinstance(model, deepspeed.PipelineEngine)`: both work; building a pipeline is refused."""
    import pytest

    from zeromem.deepspeed.pipe import LayerSpec, PipelineModule

    class GPTModelPipe(PipelineModule):  # defined at import, as Megatron-DeepSpeed's is
        pass

    for build in (GPTModelPipe, lambda: LayerSpec(object), zeromem.deepspeed.PipelineEngine):
        with pytest.raises(NotImplementedError, match="no pipeline parallelism"):
            build()
