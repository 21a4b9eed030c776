"""ZeRO-3 behaviour beyond parity: reuse, external parameters, eval, limits, divergence."""
from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeromem
from harness import run_distributed, run_together
from models import Deep, micro_batch, Reference, state_dict_diff, TinyLM
from setups import parity_config, reference_step
from zeromem.stage3.fetch import Stage3DivergenceError


class Reuse(nn.Module):
    """A block called twice per forward and an embedding read outside its module."""

    def __init__(self, vocab: int = 13, dim: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens, targets, use_sometimes=True):
        h = self.embed(tokens)
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))                # the same module again
        logits = F.linear(self.norm(h), self.embed.weight)  # parameter used outside its module
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reuse_and_eval(rank, world_size):
    torch.manual_seed(0)
    model = Reuse()
    ref = Reference(copy.deepcopy(model), per_rank=False)
    engine = zeromem.initialize(model, parity_config(3, 1, 0.0, world_size))
    diffs = []
    for step in range(3):
        tokens, targets = micro_batch(step, rank, 0)
        engine.backward(engine(tokens, targets))
        engine.step()
        ref.step(step, world_size, 1)
        diffs.append(state_dict_diff(engine.full_state_dict(), ref.model))
    # evaluation and a generation-style loop under no_grad: same numbers, nothing left gathered
    tokens, targets = micro_batch(9, 0, 0)
    with torch.no_grad():
        losses = [engine(tokens[:, :t + 1], targets[:, :t + 1]).item() for t in range(4)]
        expected = [ref.model(tokens[:, :t + 1], targets[:, :t + 1]).item() for t in range(4)]
    leaked = engine.stage3.stats.live
    shapes = [tuple(p.shape) for p in engine.module.parameters()]
    return diffs, losses, expected, leaked, shapes


def test_reused_module_external_parameter_and_eval(world):
    for diffs, losses, expected, leaked, shapes in world["reuse_and_eval"]:
        assert max(diffs) <= 1e-5, diffs
        assert losses == pytest.approx(expected, abs=1e-5)
        assert leaked == 0, "gathered parameters leaked out of the forward"
        assert all(s == (0,) for s in shapes), "outside a gather a parameter is empty"


def live_limit(rank, world_size):
    unit = 64 * 64 + 64
    limit = 3 * unit
    torch.manual_seed(0)
    engine = zeromem.initialize(Deep(), {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 10 * unit,
                              "stage3_max_live_parameters": limit}},
        fetch_units=(nn.Linear,))  # one unit a layer (by default the six would be merged)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 64)))
        engine.step()
    peaks = {"limit": engine.stage3.stats.peak}
    torch.manual_seed(0)  # the window alone: two units ahead, no live limit
    engine = zeromem.initialize(Deep(), {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 2 * unit}},
        fetch_units=(nn.Linear,))
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 64)))
        engine.step()
    peaks["window"] = engine.stage3.stats.peak
    saved = []  # what autograd keeps from forward for backward
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = engine(torch.randn(2, 64))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    peaks["saved_bytes"] = sum(storages.values())
    engine.backward(loss)
    engine.step()
    return peaks, limit, unit


def test_prefetch_respects_max_live_parameters_and_its_window(world):
    for peaks, limit, unit in world["live_limit"]:
        assert unit < peaks["limit"] <= limit + unit  # an on-demand gather may exceed it by one unit
        assert peaks["limit"] <= limit + 64 * 2       # padding of one unit at N_d = 2 at most
        # stage3_prefetch_bucket_size of two units: the unit in use and two gathered ahead,
        # however many layers follow (units already ahead count against the window)
        assert 2 * unit < peaks["window"] <= 3 * (unit + 2), peaks
        # After forward the views of gathered weights autograd saved hold no memory (the
        # gather before backward refills them): activations only, less than one unit's bytes
        assert peaks["saved_bytes"] < 4 * unit, peaks


def diverge(rank, world_size):
    os.environ["ZEROMEM_GATHER_TIMEOUT_S"] = "2"
    torch.manual_seed(0)
    engine = zeromem.initialize(TinyLM(), parity_config(3, 1, 0.0, world_size))
    tokens, targets = micro_batch(0, rank, 0)
    engine.backward(engine(tokens, targets))
    engine.step()
    outcome = "idle"
    if rank == 0:  # the classic ZeRO-3 hang: evaluation on rank 0 only
        try:
            with torch.no_grad():
                engine(tokens, targets)
            outcome = "no error"
        except Stage3DivergenceError as error:
            outcome = str(error)
    else:
        time.sleep(4)  # rank 1 goes on with other work and never joins the gather
    # the ranks parted on purpose: no exit barrier to wait out (the harness's meets them)
    zeromem.shutdown(barrier_timeout_s=0)
    torch.distributed.destroy_process_group()
    return outcome


def test_one_rank_forward_fails_fast_naming_module_and_rank():
    message = run_distributed(diverge, 2, timeout_s=120)[0]
    assert "ZeRO-3 ranks diverged" in message, message
    assert "rank(s) [1]" in message and "'" in message, message


def against_fsdp2(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    ours = Deep(width=32, depth=4)
    torch.manual_seed(0)
    theirs = Deep(width=32, depth=4)
    for layer in theirs.layers:
        fully_shard(layer)
    fully_shard(theirs)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.01)
    engine = zeromem.initialize(ours, parity_config(3, 1, 0.0, world_size))
    diffs = []
    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x))
        engine.step()
        opt.zero_grad()
        theirs(x).backward()
        opt.step()
        full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
        mine = engine.full_state_dict()
        diffs.append(max((mine[k] - full[k]).abs().max().item() for k in mine) if mine else 0.0)
    return diffs


def test_stage3_matches_fsdp2(world):
    for diffs in world["against_fsdp2"]:
        assert max(diffs) <= 1e-5, diffs


def gpt_stage3_like_stage2(rank, world_size):
    """The demo's GPT: Init, one unit per block, persistent small units, prefetch vs stage 2."""
    from gpt import GPT, Block, GPTConfig
    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        shape = GPTConfig(block_size=32, n_layer=2, n_embd=64)
        if stage == 3:
            with zeromem.Init():
                model = GPT(shape)
        else:
            model = GPT(shape)
        engine = zeromem.initialize(model, {
            "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10000,
                                  "stage3_prefetch_bucket_size": 20000}}, fetch_units=(Block,))
        # Gradient readiness is counted once, by the unit (sharded_unit.py): one hook per
        # parameter, none in the reducer, so nothing can act on a unit twice (issue 11).
        hooks = {len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()}
        assert hooks == {1}, f"post-accumulate-grad hooks per parameter: {hooks}"
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            tokens = torch.randint(0, 256, (4, 33), generator=g)
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
            _assert_state_matches_memory(engine)
        out[stage] = engine.full_state_dict()
    return max((out[2][k] - out[3][k]).abs().max().item() for k in out[2]) if out[2] else 0.0


def _assert_state_matches_memory(engine) -> None:
    """Between steps a group's parameters hold what its state says (flat.GroupState)."""
    from zeromem.flat import GroupState
    for g in engine.groups:
        whole = g.state in (GroupState.WHOLE, GroupState.GATHERED)
        assert whole == all(p.numel() == s.numel for p, s in zip(g.params, g.slots)), g.state
        assert (g.full is not None) == (g.state is GroupState.GATHERED), g.state


def test_gpt_with_block_units_trains_like_stage_2(world):
    assert max(world["gpt_stage3_like_stage2"]) <= 1e-6


class Branchy(nn.Module):
    """Branches that first read another module's parameter at a later step.

    `tied` (a flag argument) swaps the head module for `F.linear(h, embed.weight)`;
    `gated` (module state, not an argument) adds a module and reads `block.weight`
    after it, so the pass leaves its recorded order before the external read.
    """

    def __init__(self, vocab: int = 13, dim: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.gated = False

    def forward(self, tokens, targets, tied=False):
        h = torch.tanh(self.block(self.embed(tokens)))          # (B, T, dim)
        if self.gated:
            h = h * torch.sigmoid(self.gate(h))
            h = h + F.linear(h, self.block.weight)              # read outside `block`
        logits = F.linear(h, self.embed.weight) if tied else self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def engine_step(engine, rank: int, step: int, **kwargs) -> float:
    loss = engine(*micro_batch(step, rank, 0), **kwargs)
    engine.backward(loss)
    engine.step()
    return loss.item()


def eval_first_and_late_branches(rank, world_size):
    out = {}
    # (a) a no_grad forward before any training step; the head reads embed.weight in the parent
    torch.manual_seed(0)
    model = Reuse()
    ref = Reference(copy.deepcopy(model), per_rank=False)
    engine = zeromem.initialize(model, parity_config(3, 1, 0.0, world_size))
    batch = micro_batch(7, 0, 0)
    with torch.no_grad():
        out["eval_first"] = (engine(*batch).item(), ref.model(*batch).item())
    diffs = []
    for step in range(2):
        engine_step(engine, rank, step)
        ref.step(step, world_size, 1)
        diffs.append(state_dict_diff(engine.full_state_dict(), ref.model))
    out["train_after_eval"] = diffs
    # (b) branches first taken at steps 1 and 2 (a flag argument, then module state)
    torch.manual_seed(0)
    model = Branchy()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    engine = zeromem.initialize(model, parity_config(3, 1, 0.0, world_size))
    losses, diffs = [], []
    for step, (tied, gated) in enumerate([(False, False), (True, False), (True, True),
                                          (False, True)]):
        model.gated = ref_model.gated = gated
        mine = engine_step(engine, rank, step, tied=tied)
        losses.append((mine, reference_step(ref_model, opt, step, world_size, tied=tied)[rank]))
        diffs.append(state_dict_diff(engine.full_state_dict(), ref_model))
    with torch.no_grad():
        losses.append((engine(*batch, tied=True).item(), ref_model(*batch, tied=True).item()))
    out["branches"] = (losses, diffs)
    out["leaked"] = engine.stage3.stats.live
    return out


def test_eval_before_training_and_branches_reading_external_parameters(world):
    for out in world["eval_first_and_late_branches"]:
        got, expected = out["eval_first"]
        assert got == pytest.approx(expected, abs=1e-5)
        assert max(out["train_after_eval"]) <= 1e-5, out["train_after_eval"]
        losses, diffs = out["branches"]
        assert max(abs(a - b) for a, b in losses) <= 1e-5, losses
        assert max(diffs) <= 1e-5, diffs
        assert out["leaked"] == 0, "gathered parameters leaked out of the forward"


class Pair(nn.Module):
    """Two layers in one fetch unit; `b` runs only when the flag says so."""

    def __init__(self, dim: int = 10):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, h, use_b: bool):
        h = torch.tanh(self.a(h))
        return h + self.b(h) if use_b else h


class Partial(nn.Module):
    def __init__(self, vocab: int = 13, dim: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pair = Pair(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, targets, use_b=True):
        logits = self.head(self.pair(self.embed(tokens), use_b))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def partly_used_unit(rank, world_size):
    """A unit some of whose gradients never come (`b` skipped) hands over the others at the
    end of backward, before the reducer launches it (sharded_unit.py `finish_backward`)."""
    torch.manual_seed(0)
    model = Partial()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    engine = zeromem.initialize(model, parity_config(3, 1, 0.0, world_size), fetch_units=(Pair,))
    diffs = []
    for step, use_b in enumerate([True, False, False, True]):
        engine_step(engine, rank, step, use_b=use_b)
        reference_step(ref_model, opt, step, world_size, use_b=use_b)
        diffs.append(state_dict_diff(engine.full_state_dict(), ref_model))
        assert all(p.grad is None for p in model.parameters())  # the buckets took them
    return diffs


def test_a_partly_used_unit_trains_like_one_process(world):
    for diffs in world["partly_used_unit"]:
        assert max(diffs) <= 1e-5, diffs


def submodule_called_alone(rank, world_size):
    """A submodule run on its own between the root's passes, as an encoder-decoder's
    `generate` runs its encoder: gathered on demand, and the recorded orders stay as they
    were (it was appended to the last pass's order, which then overran its prefetch table)."""
    torch.manual_seed(0)
    model = Reuse()
    ref = Reference(copy.deepcopy(model), per_rank=False)
    engine = zeromem.initialize(model, parity_config(3, 1, 0.0, world_size))
    tokens, targets = micro_batch(9, 0, 0)
    got, expected, diffs = [], [], []
    for step in range(3):
        with torch.no_grad():
            got.append(engine(tokens, targets).item())  # an evaluation pass, recorded
            got.append(engine.module.block(engine.module.embed(tokens)).sum().item())  # alone
            got.append(engine(tokens, targets).item())  # the same kind of pass again
            expected += [ref.model(tokens, targets).item(),
                         ref.model.block(ref.model.embed(tokens)).sum().item(),
                         ref.model(tokens, targets).item()]
        engine.backward(engine(*micro_batch(step, rank, 0)))
        engine.step()
        ref.step(step, world_size, 1)
        diffs.append(state_dict_diff(engine.full_state_dict(), ref.model))
    return got, expected, diffs, engine.stage3.stats.live


def test_a_submodule_called_alone_between_passes(world):
    for got, expected, diffs, leaked in world["submodule_called_alone"]:
        assert got == pytest.approx(expected, abs=1e-5)
        assert max(diffs) <= 1e-5, diffs
        assert leaked == 0, "gathered parameters leaked out of the forward"


@pytest.fixture(scope="module")
def world() -> dict[str, list]:
    """This file's 2-rank cases (but the divergence one) in one spawned world: spawning
    costs more than a case."""
    return run_together({name: (fn, ()) for name, fn in (
        ("reuse_and_eval", reuse_and_eval), ("live_limit", live_limit),
        ("against_fsdp2", against_fsdp2), ("gpt_stage3_like_stage2", gpt_stage3_like_stage2),
        ("eval_first_and_late_branches", eval_first_and_late_branches),
        ("partly_used_unit", partly_used_unit),
        ("submodule_called_alone", submodule_called_alone))}, 2)
