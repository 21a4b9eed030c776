"""A bf16 HF Llama through zeromem computes what HF's own bf16 model computes, at long positions.

HF loads a model with `dtype=torch.bfloat16` with its rotary `inv_freq` buffer in fp32.
Before stop 49 zeromem cast every buffer to bf16 at `initialize` (DeepSpeed's old
`module.bfloat16()`): the rotary cosines then differed from HF's by up to 0.71 at
positions near 4096, and the logits by 0.004 on this tiny model. Now buffers keep their
dtype (module_dtypes.py), and the engine's logits equal the one-process model's exactly,
on every rank, at stages 2 and 3.
"""
from __future__ import annotations

import pytest
import torch

import zeromem
from harness import run_distributed

transformers = pytest.importorskip("transformers")

POSITIONS = 1024


def tiny_llama(directory: str) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=4096)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 64, (1, POSITIONS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits.float()


def compare(rank, world_size, directory: str) -> dict:
    load = lambda: transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    want = logits(load().eval())
    out = {}
    for stage in (2, 3):
        engine = zeromem.initialize(load(), {
            "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
        engine.eval()
        rotary = engine.module.model.rotary_emb
        out[stage] = (rotary.inv_freq.dtype, float((logits(engine) - want).abs().max()))
        engine.close()
    return out


def test_a_bf16_llama_keeps_hfs_fp32_rotary_frequencies_and_its_logits(tmp_path):
    tiny_llama(str(tmp_path))
    for rank, out in enumerate(run_distributed(compare, 2, str(tmp_path))):
        for stage, (dtype, diff) in out.items():
            assert dtype == torch.float32, f"rank {rank}, stage {stage}: inv_freq in {dtype}"
            assert diff == 0.0, f"rank {rank}, stage {stage}: logits differ from HF's by {diff}"
