"""DeepSpeed config features zeromem implements, in 2-rank runs (gloo, CPU).

- Lamb from the config trains like one process running Lamb on whole parameters, at
  stages 0-3: the trust ratio is each parameter's, though its shards sit on two ranks.
- OneCycle from the config moves the lr and Adam's beta1 of the master shards' optimizer
  step by step as in one process, and the training matches.
"""
from __future__ import annotations

import copy

import pytest

import zeromem
from harness import run_distributed
from models import Reference, micro_batch, state_dict_diff, uses_sometimes
from setups import build_tiny_lm, parity_config
from zeromem.optimizers import Lamb
from zeromem.schedulers import OneCycle

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


ONE_CYCLE = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 3e-2,
                                            "cycle_first_step_size": 2, "cycle_second_step_size": 3,
                                            "decay_step_size": 1, "decay_lr_rate": 0.5,
                                            "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}}


def one_cycle_parity(rank: int, world_size: int, stage: int) -> tuple[float, list]:
    ref = Reference(build_tiny_lm(False), lr=0.5)  # OneCycle sets absolute lrs
    ref_schedule = OneCycle(ref.opt, **ONE_CYCLE["params"])
    engine = zeromem.initialize(build_tiny_lm(False), parity_config(
        stage, 1, 0.0, world_size, optimizer={"type": "AdamW", "params": {"lr": 0.5,
                                                                           "weight_decay": 0.01}},
        scheduler=ONE_CYCLE))
    assert isinstance(engine.lr_scheduler, OneCycle)
    worst, seen = 0.0, []
    for step in range(8):  # the whole cycle and three decay steps
        group, want = engine.optimizer.param_groups[0], ref.opt.param_groups[0]
        assert group["lr"] == want["lr"] and group["betas"] == want["betas"], step
        seen.append((group["lr"], group["betas"][0]))
        tokens, targets = micro_batch(step, rank, 0)
        engine.backward(engine(tokens, targets, uses_sometimes(step, rank, 0)))
        engine.step()
        ref.step(step, world_size, 1)
        ref_schedule.step()
        worst = max(worst, state_dict_diff(engine.full_state_dict(), ref.model))
    return worst, seen


def test_one_cycle_drives_lr_and_momentum_of_the_sharded_optimizer():
    results = run_distributed(one_cycle_parity, 2, 2)
    assert max(worst for worst, _ in results) <= 1e-5
    lrs = [lr for lr, _ in results[0][1]]
    moms = [mom for _, mom in results[0][1]]
    assert lrs[:6] == pytest.approx([1e-3, 1.55e-2, 3e-2, 2.033e-2, 1.067e-2, 1e-3], rel=1e-3)
    assert lrs[6:] == pytest.approx([1e-3 / 1.5, 1e-3 / 2.0])  # decay after the cycle
    assert moms[0] == 0.85 and moms[2] == pytest.approx(0.85) and moms[5] == pytest.approx(0.95)
