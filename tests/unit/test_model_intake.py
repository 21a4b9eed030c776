"""Models `initialize` must make whole before it takes them: a lazy module (nn.LazyLinear)
has no parameters until its first forward, refused by name before anything reads a shape
(or starts a process group), as is a complex parameter; a model built on the meta device
gets its modules' `reset_parameters()` values, and a tensor none of them sets is refused
by name."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeromem
from zeromem.module_state import materialize_meta, refuse_untakeable

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_optimization": {"stage": 3}}


def test_initialize_names_the_parameter_a_lazy_module_has_not_made():
    model = nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(4), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"'1\.weight' \(and 3 more\) is not made yet.*first forward"):
        zeromem.initialize(model, CONFIG)


def test_after_its_first_forward_a_lazy_module_is_taken():
    model = nn.Sequential(nn.LazyLinear(4))
    model(torch.zeros(1, 3))
    refuse_untakeable(model)  # nothing left to make


def test_a_complex_parameter_is_refused_by_name_with_the_real_view_to_use():
    model = nn.Linear(3, 3)
    model.register_parameter("spectrum", nn.Parameter(torch.zeros(3, dtype=torch.cfloat)))
    with pytest.raises(ValueError, match=r"'spectrum' is complex.*torch\.view_as_real"):
        refuse_untakeable(model)


class Norm(nn.Module):
    """Values set in __init__ only (an RMSNorm's ones, rotary frequencies, position ids)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.register_buffer("freqs", torch.arange(width) / width, persistent=False)
        self.register_buffer("positions", torch.arange(width), persistent=False)


def standard() -> nn.Module:
    return nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))


def test_standard_layers_on_the_meta_device_get_an_ordinary_builds_values():
    torch.manual_seed(0)
    plain = standard()
    with torch.device("meta"):
        model = standard()
    torch.manual_seed(0)  # the same draws, in the same module order
    materialize_meta(model, torch.device("cpu"))
    for (name, got), want in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(got, want), name


def test_tensors_no_reset_parameters_sets_are_refused_by_name():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Norm(4))
    with pytest.raises(ValueError, match=r"^1\.weight \(Norm\), 1\.freqs \(Norm\), 1\.positions "
                                         r"\(Norm\): built on the meta device.*zeromem\.Init"):
        materialize_meta(model, torch.device("cpu"))
    with torch.device("meta"):
        attention = nn.MultiheadAttention(4, 2)  # its own init is private (_reset_parameters)
    with pytest.raises(ValueError, match=r"^in_proj_weight \(MultiheadAttention\), in_proj_bias"):
        materialize_meta(attention, torch.device("cpu"))
