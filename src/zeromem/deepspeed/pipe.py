"""DeepSpeed's `deepspeed.pipe` and `PipelineEngine`, as far as scripts that run no
pipeline touch them.

zeromem has no pipeline parallelism: data parallelism with ZeRO, and a tensor-parallel
model passed in with its group. Megatron-DeepSpeed imports `deepspeed.pipe` when it
imports its GPT model and asks `isinstance(model, deepspeed.PipelineEngine)` of every
engine, pipeline or not (`megatron/training.py`). These names let its data-parallel path
(`--no-pipeline-parallel`) run; building a pipeline is refused by name.
"""
from __future__ import annotations

from typing import NoReturn

from torch import nn

_REFUSED = ("{}: zeromem has no pipeline parallelism; build the model as one nn.Module "
            "(Megatron-DeepSpeed: --no-pipeline-parallel) and let ZeRO shard it")


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(_REFUSED.format(name))


class PipelineEngine:
    """No engine zeromem returns is one: `isinstance(engine, PipelineEngine)` is False."""

    def __init__(self, *args, **kwargs):
        _refuse("deepspeed.PipelineEngine")


class PipelineModule(nn.Module):
    """A model split into pipeline stages: refused when built (subclassing it, as
    Megatron-DeepSpeed's `GPTModelPipe` does at import, is allowed)."""

    def __init__(self, *args, **kwargs):
        _refuse("deepspeed.pipe.PipelineModule")


class LayerSpec:
    def __init__(self, *args, **kwargs):
        _refuse("deepspeed.pipe.LayerSpec")


class TiedLayerSpec(LayerSpec):
    pass


__all__ = ["PipelineEngine", "PipelineModule", "LayerSpec", "TiedLayerSpec"]
