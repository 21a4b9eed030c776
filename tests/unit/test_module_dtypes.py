"""Which dtype a precision block gives the module's frozen parameters and buffers
(zeromem.module_dtypes). No process group: `cast_module` is pure over one module."""
from __future__ import annotations

import torch
from torch import nn

from zeromem.config.schema import Config
from zeromem.module_dtypes import cast_module


class Rotary(nn.Module):
    """A rotary embedding as HF builds it: an fp32 `inv_freq` buffer and no parameters."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8),
                             persistent=False)


class Gate(nn.Module):
    """An MoE router as DeepSeek-V3's: a weight, and a bias buffer HF keeps in fp32."""

    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("e_score_correction_bias", torch.tensor([5.001, 5.002, 5.003, 5.004]))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = Rotary()
        self.norm = nn.BatchNorm1d(4)
        self.gate = Gate()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.register_buffer("step", torch.tensor(3))
        self.other = nn.Linear(4, 4)  # a buffer of the gate's name outside it: not on its list
        self.other.register_buffer("e_score_correction_bias", torch.zeros(4))


def dtypes(model: nn.Module, data: dict) -> dict[str, torch.dtype]:
    cast_module(model, Config.load({"train_micro_batch_size_per_gpu": 1, **data}))
    return {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}


BF16 = {"bf16": {"enabled": True}}


def test_buffers_keep_their_dtype_but_a_modules_own_statistics_follow_its_parameters():
    got = dtypes(Model(), BF16)
    assert got["rotary.inv_freq"] == torch.float32  # HF's, FSDP2's and DeepSpeed 0.19.8's
    assert got["norm.running_mean"] == got["norm.running_var"] == torch.bfloat16  # as norm.weight
    assert got["norm.num_batches_tracked"] == got["step"] == torch.int64
    assert got["frozen.weight"] == got["gate.weight"] == torch.bfloat16


def test_the_models_hf_lists_keep_their_buffers_in_fp32():
    model = Model()
    exact = model.gate.e_score_correction_bias.clone()
    got = dtypes(model, BF16)
    assert got["gate.e_score_correction_bias"] == torch.float32
    assert torch.equal(model.gate.e_score_correction_bias, exact)  # bf16 would leave 5.0 for all
    assert got["other.e_score_correction_bias"] == torch.bfloat16  # a list names its module's
    assert dtypes(Model(), {**BF16, "data_types": {"keep_in_fp32_modules": []}})[
        "gate.e_score_correction_bias"] == torch.bfloat16


def test_fp16_keeps_the_fp16_only_list_too_and_a_given_list_replaces_the_models():
    model = Model()
    model.norm._keep_in_fp32_modules = ["running_var"]  # HF: kept in fp32 under fp16 only
    fp16 = dtypes(model, {"fp16": {"enabled": True}})
    assert fp16["norm.running_var"] == torch.float32 and fp16["norm.running_mean"] == torch.float16
    model = Model()
    model.norm._keep_in_fp32_modules = ["running_var"]
    assert dtypes(model, BF16)["norm.running_var"] == torch.bfloat16
    given = dtypes(Model(), {**BF16, "data_types": {"keep_in_fp32_modules": ["norm.running_*"]}})
    assert given["norm.running_mean"] == given["norm.running_var"] == torch.float32
    assert given["gate.e_score_correction_bias"] == torch.bfloat16  # the model's list replaced


def test_buffer_dtype_casts_every_floating_buffer_as_deepspeeds_old_blanket_cast():
    got = dtypes(Model(), {**BF16, "data_types": {"buffer_dtype": "bf16", "keep_in_fp32_modules": []}})
    assert got["rotary.inv_freq"] == got["norm.running_mean"] == torch.bfloat16
    assert got["step"] == torch.int64


def test_fp32_casts_nothing_but_the_buffers_buffer_dtype_names():
    model = Model().to(torch.bfloat16)
    model.frozen.to(torch.float16)
    got = dtypes(model, {})
    assert got["frozen.weight"] == torch.float16 and got["rotary.inv_freq"] == torch.bfloat16
    got = dtypes(Model(), {"data_types": {"buffer_dtype": "bf16"}})
    assert got["rotary.inv_freq"] == torch.bfloat16 and got["frozen.weight"] == torch.float32
