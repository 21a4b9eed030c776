"""Stage 3 with the default fetch units (merged blocks, a tied embedding alone) trains exactly
like one process on the global batch: the demo GPT and tiny HF GPT-2 / Llama, every rank
checking its own master and parameter shards, persistence threshold 0 (all partitioned).

Then tiny HF GPT-2 / Llama at the default persistence threshold, where every unit is under
it: they train alike with every unit persistent (GPT-2's three merged into two, stage3/units.py
`merge_persistent`), no module but the root keeps stage-3 hooks (nothing to gather), and only
the first forward runs the parameter tracer (an empty order is recorded)."""
from __future__ import annotations

import copy

import pytest
import torch

import zeromem
from harness import run_distributed
from setups import hf_tiny_builders

VOCAB, SEQ, BATCH, STEPS = 256, 8, 2, 3


def config(persistence: int | None = 0) -> dict:
    """Stage 3; `persistence` None leaves stage3_param_persistence_threshold at its default."""
    zero = {"stage": 3} if persistence is None else {
        "stage": 3, "stage3_param_persistence_threshold": persistence}
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0,
            # SGD: AdamW magnifies float rounding where a gradient is ~eps (stage 2 too)
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": zero}


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
        out[name] = train(name, build, config(), rank, world_size)
    hf = hf_tiny_builders(vocab=VOCAB, seq=SEQ)
    for name in ("gpt2", "llama"):  # every unit under the default persistence threshold
        out[f"{name}-persistent"] = train(name, hf[name], config(None), rank, world_size)
    return out


def train(name: str, build, cfg: dict, rank: int, world_size: int):
    """(units, losses, diffs, leaked, moved) of STEPS steps against one process, and
    (units persistent, modules with stage-3 hooks, first forwards that ran the tracer)."""
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    engine = zeromem.initialize(model, cfg)
    assert engine.fetch_unit_report.startswith("stage-3 fetch units (default"), name
    units = len(engine.stage3.units)
    traced: list[bool] = []  # per forward: was the tracer on while the first layer ran?
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))[0]
    layer.register_forward_pre_hook(lambda *_: traced.append(engine.stage3.tracing is not None))
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
    names = {id(m): n or "(root)" for n, m in model.named_modules()}
    hooked = sorted(names[k] for k in engine.stage3.module_hooks)
    persistent = [u.persistent for u in engine.stage3.units]
    return (units, losses, diffs, engine.stage3.stats.live, moved), (persistent, hooked, traced)


def test_stage3_default_units_match_one_process_on_every_rank():
    pytest.importorskip("transformers")
    for per_model in run_distributed(train_with_default_units, 2):
        assert set(per_model) == {"gpt", "gpt2", "llama", "gpt2-persistent", "llama-persistent"}
        for name in ("gpt2-persistent", "llama-persistent"):
            (units, losses, diffs, _, moved), (persistent, hooked, traced) = per_model.pop(name)
            assert units == 2 and persistent == [True, True], (name, persistent)
            assert hooked == ["(root)"], (name, "hooked though nothing to gather", hooked)
            assert traced == [True] + [False] * (STEPS - 1), (name, "tracer on", traced)
            assert max(losses) < 1e-5 and max(diffs) < 1e-5, (name, losses, diffs)
            assert moved > 1e-3, (name, "the reference did not train")
        for name, ((units, losses, diffs, leaked, moved), _) in per_model.items():
            assert units >= 2, (name, units)  # merged, yet more than one unit
            assert max(losses) < 1e-5, (name, losses)
            assert max(diffs) < 1e-5, (name, diffs)
            assert leaked == 0, (name, "gathered parameters left after the step")
            assert moved > 1e-3, (name, "the reference did not train")
