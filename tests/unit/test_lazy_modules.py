"""A lazy module (nn.LazyLinear) has no parameters until its first forward: `initialize`
refuses it by name, before it reads a shape (or starts a process group)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeromem
from zeromem.module_state import refuse_lazy

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_optimization": {"stage": 3}}


def test_initialize_names_the_parameter_a_lazy_module_has_not_made():
    model = nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(4), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"'1\.weight' \(and 3 more\) is not made yet.*first forward"):
        zeromem.initialize(model, CONFIG)


def test_after_its_first_forward_a_lazy_module_is_taken():
    model = nn.Sequential(nn.LazyLinear(4))
    model(torch.zeros(1, 3))
    refuse_lazy(model)  # nothing left to make
