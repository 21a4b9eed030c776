"""Stages 0/1/2/3 train exactly like one process on the global batch (fp32, <= 1e-5).

Every rank checks its own view (its master shard, its parameter shard and, where
parameters are whole, the whole flat buffer), not only rank 0's gathered state dict.
AdamW barely sees a gradient's magnitude, so the SGD + momentum matrix (no clipping,
accumulation > 1, fp16 with a loss scale) is what catches a missing 1/N_d,
1/accumulation or 1/loss-scale.
"""
from __future__ import annotations

import copy
import itertools
import tempfile

import pytest
import torch
import torch.distributed as dist

import zeromem
from harness import run_distributed, run_together
from models import Reference, TinyLM, micro_batch, own_view_diff, state_dict_diff, uses_sometimes
from setups import build_tiny_lm, parity_config

STEPS = 3


def train_and_compare(rank: int, world_size: int, stage: int, gas: int, clip: float,
                      extra: dict | None = None, tol: float = 1e-5,
                      use_init: bool = False, overlap: bool | None = None) -> list[float]:
    per_rank = stage < 3  # stage 3: every rank runs the same modules
    ref = Reference(build_tiny_lm(False), clip=clip, per_rank=per_rank)
    initial = copy.deepcopy(ref.model)
    model = build_tiny_lm(use_init)
    engine = zeromem.initialize(model, parity_config(stage, gas, clip, world_size, overlap,
                                              **(extra or {})))
    diffs = []
    for step in range(STEPS):
        for micro in range(gas):
            tokens, targets = micro_batch(step, rank, micro)
            loss = engine(tokens, targets, uses_sometimes(step, rank, micro, per_rank))
            engine.backward(loss)
            engine.step()
        ref.step(step, world_size, gas)
        diffs.append(max(state_dict_diff(engine.full_state_dict(), ref.model),
                         own_view_diff(engine, ref.model)))
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS * gas
    assert own_view_diff(engine, initial) > 1e-3, f"rank {rank} did not train"
    assert max(diffs) <= tol, f"stage {stage} gas {gas} clip {clip}: diffs {diffs}"
    return diffs


def parity_matrix(rank: int, world_size: int) -> dict:
    out = {}
    for stage, gas, clip in itertools.product((0, 1, 2, 3), (1, 3), (0.0, 0.05)):
        # with clipping, buckets are reduced asynchronously while backward goes on
        out[(stage, gas, clip)] = train_and_compare(rank, world_size, stage, gas, clip,
                                                    overlap=True if clip else None)
    for gas, clip in itertools.product((1, 3), (0.0, 0.05)):  # stage 3 built under Init
        out[("init", gas, clip)] = train_and_compare(rank, world_size, 3, gas, clip, use_init=True)
    return out


@pytest.fixture(scope="module")
def world_of_two() -> dict[str, list]:
    """This file's 2-rank cases, in one spawned world (spawning costs more than a case)."""
    return run_together({"parity": (parity_matrix, ()), "clipping": (clipping_is_active, ()),
                         "seeded": (differently_seeded_init, ())}, 2)


@pytest.fixture(scope="module")
def world_of_four() -> dict[str, list]:
    return run_together({"parity": (parity_matrix, ()), "sgd": (sgd_matrix, ())}, 4)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp32_parity_all_stages(request, world_size):
    if world_size == 1:
        results = run_distributed(parity_matrix, 1)
    else:
        fixture = {2: "world_of_two", 4: "world_of_four"}[world_size]
        results = request.getfixturevalue(fixture)["parity"]
    for rank_results in results:  # each rank compared its own view with the reference
        assert len(rank_results) == 20
        for diffs in rank_results.values():
            assert all(d <= 1e-5 for d in diffs)


def clipping_is_active(rank: int, world_size: int) -> dict[int, tuple[float, float]]:
    """Pre-clip norm against torch's on the same global batch, with and without accumulation."""
    out = {}
    for gas in (1, 3):
        torch.manual_seed(0)
        engine = zeromem.initialize(TinyLM(), parity_config(2, gas, 0.05, world_size))
        for micro in range(gas):
            tokens, targets = micro_batch(0, rank, micro)
            engine.backward(engine(tokens, targets))
            engine.step()
        torch.manual_seed(0)
        ref = TinyLM()
        for r in range(world_size):
            for micro in range(gas):
                t, y = micro_batch(0, r, micro)
                (ref(t, y) / (world_size * gas)).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in ref.parameters() if p.requires_grad], 1e9)
        out[gas] = (engine.get_global_grad_norm(), float(ref_norm))
    return out


def test_pre_clip_norm_matches_torch(world_of_two):
    for per_gas in world_of_two["clipping"]:  # every rank's own norm
        for norm, ref_norm in per_gas.values():
            assert norm == pytest.approx(ref_norm, rel=1e-5)
            assert norm > 0.05  # so the parity cases with clip=0.05 really clip


def differently_seeded_init(rank: int, world_size: int) -> None:
    """Each rank builds the model from its own seed; initialize() must make rank 0's win."""
    for stage in (0, 1, 2, 3):
        torch.manual_seed(rank)
        engine = zeromem.initialize(TinyLM(), parity_config(stage, 1, 0.0, world_size))
        torch.manual_seed(0)
        ref = Reference(TinyLM(), per_rank=stage < 3)
        assert own_view_diff(engine, ref.model) <= 1e-6, f"rank {rank} stage {stage}: not rank 0's"
        for step in range(2):
            tokens, targets = micro_batch(step, rank, 0)
            engine.backward(engine(tokens, targets, uses_sometimes(step, rank, 0, stage < 3)))
            engine.step()
            ref.step(step, world_size, 1)
        assert own_view_diff(engine, ref.model) <= 1e-5, f"rank {rank} stage {stage}: diverged"


def test_differently_seeded_ranks_start_from_rank_0(world_of_two):
    assert world_of_two["seeded"] == [None, None]  # each rank asserted in the world


# -- SGD + momentum: sees the gradient's magnitude -----------------------------------------
SGD_STEPS = 3
SGD_GAS = 2
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
SAMPLES = torch.Generator().manual_seed(5)
POOL_TOKENS = torch.randint(0, 13, (64, 5), generator=SAMPLES)
POOL_TARGETS = torch.randint(0, 13, (64, 5), generator=SAMPLES)


def shuffled_batch(step: int, rank: int, micro: int, batch: int = 4):
    """Rank `rank` reads one shared pool of samples in its own order (seeded by its rank)."""
    order = torch.randperm(len(POOL_TOKENS), generator=torch.Generator().manual_seed(7919 * rank + 1))
    start = batch * (step * SGD_GAS + micro) % len(order)
    idx = order[start:start + batch]
    return POOL_TOKENS[idx], POOL_TARGETS[idx]


def dp_layout(rank: int, world_size: int):
    """(dp group, replica index, ranks of my replica): two replicas of N_d=2 when 4 ranks.

    The replicas are interleaved ({0, 2} and {1, 3}) as under tensor parallelism, so a
    collective over the world group instead of the dp group mixes the two replicas.
    """
    if world_size < 4:
        return None, 0, list(range(world_size))
    groups = [dist.new_group([r for r in range(world_size) if r % 2 == i]) for i in range(2)]
    replica = rank % 2
    return groups[replica], replica, [r for r in range(world_size) if r % 2 == replica]


SGD_CASES = [(stage, precision, overlap) for stage in (0, 1, 2, 3)
             for precision, overlap in (("fp32", False), ("fp32", True), ("fp16", True))]
SGD_CASES += [(2, "fp32-offload-cpu", True), (3, "fp32-offload-nvme", True)]
FP16 = {"fp16": {"enabled": True, "loss_scale": 1024}}  # static: no skipped steps


def offload(kind: str, swap_dir: str) -> dict:
    """zero_optimization keys for an optimizer offloaded to the host or to a swap file."""
    if kind == "cpu":
        return {"offload_optimizer": {"device": "cpu"}}
    # small sub-groups: the swapped optimizer steps TinyLM's shard in many pieces
    return {"offload_optimizer": {"device": "nvme", "nvme_path": swap_dir}, "sub_group_size": 37}


def sgd_case(rank: int, world_size: int, stage: int, precision: str, overlap: bool) -> dict:
    """Train one case with SGD + momentum, no clipping; compare every step on this rank."""
    with tempfile.TemporaryDirectory() as swap_dir:
        return train_sgd_case(rank, world_size, stage, precision, overlap, swap_dir)


def train_sgd_case(rank: int, world_size: int, stage: int, precision: str, overlap: bool,
                   swap_dir: str) -> dict:
    dp_group, replica, members = dp_layout(rank, world_size)
    per_rank = stage < 3
    data = lambda step, dp_rank, micro: shuffled_batch(step, members[dp_rank], micro)  # noqa: E731
    torch.manual_seed(0)
    ref = Reference(TinyLM(), lr=0.05, per_rank=per_rank, optimizer="sgd", data=data)
    initial = copy.deepcopy(ref.model)
    torch.manual_seed(0)
    model = TinyLM()
    torch.manual_seed(100 + rank)  # the global RNG differs per rank from here on
    cfg = parity_config(stage, SGD_GAS, 0.0, len(members), overlap, optimizer=SGD)
    if precision == "fp16":
        cfg.update(FP16)
    if "offload" in precision:
        cfg["zero_optimization"].update(offload(precision.rsplit("-", 1)[1], swap_dir))
    engine = zeromem.initialize(model, cfg, dp_group=dp_group)
    dp_rank = members.index(rank)
    tol, norm_rel = (5e-3, 1e-2) if precision == "fp16" else (1e-5, 1e-5)
    diffs, norms = [], []
    for step in range(SGD_STEPS):
        for micro in range(SGD_GAS):
            tokens, targets = data(step, dp_rank, micro)
            engine.backward(engine(tokens, targets, uses_sometimes(step, dp_rank, micro, per_rank)))
            engine.step()
        ref.step(step, len(members), SGD_GAS)
        diffs.append(own_view_diff(engine, ref.model))
        norms.append((engine.get_global_grad_norm(), ref.last_norm))
    name = f"rank {rank} stage {stage} {precision} overlap {overlap}"
    assert own_view_diff(engine, initial) > 1e-2, f"{name}: did not train"
    assert max(diffs) <= tol, f"{name}: parameter diffs {diffs}"
    for norm, ref_norm in norms:
        assert norm == pytest.approx(ref_norm, rel=norm_rel), f"{name}: pre-clip norms {norms}"
    engine.close()  # the swap file goes before its directory does
    return {"diffs": diffs, "norms": norms}


def sgd_matrix(rank: int, world_size: int) -> dict:
    return {case: sgd_case(rank, world_size, *case) for case in SGD_CASES}


def test_sgd_momentum_parity_every_stage_every_rank(world_of_four):
    """Two interleaved replicas of N_d=2 on 4 ranks; every rank checks itself."""
    results = world_of_four["sgd"]
    assert all(len(r) == len(SGD_CASES) for r in results)
