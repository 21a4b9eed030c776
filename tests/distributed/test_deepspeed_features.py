"""DeepSpeed config features zeromem implements, in 2-rank runs (gloo, CPU).

- Lamb from the config trains like one process running Lamb on whole parameters, at
  stages 0-3: the trust ratio is each parameter's, though its shards sit on two ranks.
"""
from __future__ import annotations

import copy

import pytest

import zeromem
from harness import run_distributed
from models import Reference, micro_batch, state_dict_diff, uses_sometimes
from setups import build_tiny_lm, parity_config
from zeromem.optimizers import Lamb

STEPS = 4
LAMB = {"type": "Lamb", "params": {"lr": 2e-2, "weight_decay": 0.01, "max_coeff": 10.0,
                                   "min_coeff": 0.01}}


def lamb_parity(rank: int, world_size: int, stage: int) -> float:
    per_rank = stage < 3
    ref = Reference(build_tiny_lm(False), per_rank=per_rank)
    ref.opt = Lamb(ref.params, **LAMB["params"])  # whole parameters: one ratio each
    initial = copy.deepcopy(ref.model)
    engine = zeromem.initialize(build_tiny_lm(False),
                                parity_config(stage, 1, 0.0, world_size, optimizer=LAMB))
    assert isinstance(engine.optimizer, Lamb)
    worst = 0.0
    for step in range(STEPS):
        tokens, targets = micro_batch(step, rank, 0)
        engine.backward(engine(tokens, targets, uses_sometimes(step, rank, 0, per_rank)))
        engine.step()
        ref.step(step, world_size, 1)
        worst = max(worst, state_dict_diff(engine.full_state_dict(), ref.model))
    trained = state_dict_diff(engine.full_state_dict(), initial)  # collective: every rank
    assert rank > 0 or trained > 1e-3
    if stage > 0:  # the case a per-shard ratio gets wrong: parameters split over the ranks
        assert any(0 < g.layout.owned_slice(s.offset, s.numel)[2] < s.numel
                   for g in engine.groups for s in g.slots)
    return worst


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lamb_trains_like_whole_parameter_lamb(stage):
    worst = run_distributed(lamb_parity, 2, stage)
    assert max(worst) <= 1e-5, worst
