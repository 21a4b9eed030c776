"""The CUDA path (NCCL, streams, pinned host memory), run where a GPU is lent; skipped elsewhere.

Each case trains TinyLM on the GPU at one stage and precision and compares, on every rank,
the parameters with a single-process fp32 reference on the same global batch.
"""
from __future__ import annotations

import copy

import pytest
import torch

import zeromem
from harness import run_distributed
from models import Reference, TinyLM, micro_batch, state_dict_diff, uses_sometimes
from setups import parity_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [  # (stage, extra config, tolerance)
    (0, {}, 1e-5),
    (1, {}, 1e-5),
    (2, {}, 1e-5),
    (3, {}, 1e-5),
    (2, {"bf16": {"enabled": True}}, 3e-2),
    (3, {"bf16": {"enabled": True}}, 3e-2),
    (2, {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}, 1e-5),
    (3, {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                               "offload_param": {"device": "cpu", "pin_memory": True}}}, 1e-5),
    (2, {"activation_checkpointing": {"cpu_checkpointing": True}}, 1e-5),
]


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return out


def _on_cuda(step: int, rank: int, micro: int):
    return tuple(t.cuda() for t in micro_batch(step, rank, micro))


def train_on_gpu(rank: int, world_size: int) -> list[float]:
    worst = []
    for stage, extra, tol in CASES:
        torch.manual_seed(0)
        model = TinyLM()
        model.checkpointed = "activation_checkpointing" in extra
        ref = Reference(copy.deepcopy(model).cuda(), per_rank=stage < 3, data=_on_cuda)
        engine = zeromem.initialize(model, _merge(parity_config(stage, 1, 0.0, world_size), extra))
        assert engine.device.type == "cuda"
        diff = 0.0
        for step in range(3):
            tokens, targets = _on_cuda(step, rank, 0)
            loss = engine(tokens, targets, uses_sometimes(step, rank, 0, per_rank=stage < 3))
            engine.backward(loss)
            engine.step()
            ref.step(step, world_size, 1)
            diff = state_dict_diff(engine.full_state_dict(), ref.model)
            assert diff <= tol, (stage, extra, step, diff)
        worst.append(diff)
        engine.close()
    return worst


def test_stages_precisions_and_offload_on_cuda_match_the_reference():
    world_size = min(torch.cuda.device_count(), 2)
    for worst in run_distributed(train_on_gpu, world_size, backend="nccl"):
        assert len(worst) == len(CASES)


def offload_states_round_trip(rank: int, world_size: int) -> dict:
    """bf16 Adam at stage 2: `offload_states` gives back the device memory of the fp32
    master shards, Adam's moments and the gradient shards, `reload_states` takes it again,
    and the next steps match a run without the round trip bit for bit."""
    def run(round_trip: bool) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
        engine = zeromem.initialize(model, {
            "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2}})
        freed = 0
        for step in range(3):
            if round_trip and step == 2:
                before = torch.cuda.memory_allocated()
                engine.offload_states(non_blocking=True)
                freed = before - torch.cuda.memory_allocated()
                engine.reload_states(non_blocking=True)
                assert abs(torch.cuda.memory_allocated() - before) < 2**20  # taken again
            x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(step + rank))
            engine.backward(engine(x.cuda().bfloat16()).float().square().mean())
            engine.step()
        weights = [p.detach().clone() for p in model.parameters()]
        engine.close()
        return weights, freed

    plain, _ = run(False)
    trip, freed = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, trip))
    return {"freed": freed, "psi": sum(p.numel() for p in trip)}


def test_offload_states_gives_back_device_memory():
    world_size = min(torch.cuda.device_count(), 2)
    for result in run_distributed(offload_states_round_trip, world_size, backend="nccl"):
        # fp32 master 4 + Adam's two moments 8 bytes, over N_d; the gradient shards besides
        assert result["freed"] >= 12 * result["psi"] // world_size
