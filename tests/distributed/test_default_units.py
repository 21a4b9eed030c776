"""Stage 3 with the default fetch units (merged blocks, a tied embedding alone) trains exactly
like one process on the global batch: the demo GPT and tiny HF GPT-2 / Llama, every rank
checking its own master and parameter shards, persistence threshold 0 (all partitioned)."""
from __future__ import annotations

import copy

import pytest
import torch

import zeromem
from harness import run_distributed
from setups import hf_tiny_builders

VOCAB, SEQ, BATCH, STEPS = 256, 8, 2, 3


def config() -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH,
            # SGD: AdamW magnifies float rounding where a gradient is ~eps (stage 2 too)
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def builders() -> dict:
    from gpt import GPT, GPTConfig
    hf = hf_tiny_builders(vocab=VOCAB, seq=SEQ)
    return {"gpt": lambda: GPT(GPTConfig(block_size=SEQ, n_layer=8, n_embd=32)),
            "gpt2": hf["gpt2"], "llama": hf["llama"]}


def loss_of(name: str, model, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    if name == "gpt":
        return model(ids[:, :-1], ids[:, 1:])
    return model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss


def shard_diff(engine, reference: torch.nn.Module) -> float:
    """Largest difference between this rank's master / parameter shards and the reference."""
    worst = 0.0
    for g in engine.groups:
        for slot in g.slots:
            want = reference.get_parameter(slot.name).detach().flatten()
            start, at, n = g.owned_slice(slot)
            for shard in (g.master, g.param_shard):
                got = shard.detach()[start:start + n]
                worst = max(worst, float((got - want[at:at + n]).abs().max()) if n else 0.0)
    return worst


def train_with_default_units(rank, world_size):
    out = {}
    for name, build in builders().items():
        torch.manual_seed(0)
        model = build()
        reference = copy.deepcopy(model)
        opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        engine = zeromem.initialize(model, config())
        assert engine.fetch_unit_report.startswith("stage-3 fetch units (default"), name
        units = len(engine.stage3.units)
        losses, diffs = [], []
        for step in range(STEPS):
            loss = loss_of(name, engine, step, rank)
            engine.backward(loss)
            engine.step()
            opt.zero_grad()
            ref = [loss_of(name, reference, step, r) for r in range(world_size)]
            (sum(ref) / world_size).backward()
            opt.step()
            losses.append(abs(loss.item() - ref[rank].item()))
            diffs.append(shard_diff(engine, reference))
        moved = max(float((p.detach() - q.detach()).abs().max())
                    for p, q in zip(reference.parameters(), build().parameters()))
        out[name] = (units, losses, diffs, engine.live_params.live, moved)
    return out


def test_stage3_default_units_match_one_process_on_every_rank():
    pytest.importorskip("transformers")
    for per_model in run_distributed(train_with_default_units, 2):
        assert set(per_model) == {"gpt", "gpt2", "llama"}
        for name, (units, losses, diffs, leaked, moved) in per_model.items():
            assert units >= 2, (name, units)  # merged, yet more than one unit
            assert max(losses) < 1e-5, (name, losses)
            assert max(diffs) < 1e-5, (name, diffs)
            assert leaked == 0, (name, "gathered parameters left after the step")
            assert moved > 1e-3, (name, "the reference did not train")
