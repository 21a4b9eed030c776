"""A batch that changes during training: DeepSpeed's `set_train_batch_size` and
`set_train_micro_batch_size`, as Megatron-DeepSpeed's batch ramp-up calls the first before
every step. Until this test zeromem had neither (an AttributeError at the first step).

One spawned world of 2 gloo ranks, seeded apart, trains the same schedule at stages 0-3
through `zeromem.deepspeed.initialize` (SGD with momentum, no clipping: a wrong gradient
scale shows) and compares every rank's whole weights with one process that steps on the
mean loss of the same global batches.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import run_distributed
from user_cases import STAGES, WORLD, case, max_diff, run_cases, whole_state

MICRO = 2
# (train_batch_size, micro-batch) of each optimizer step: 1, 2, 3, 2 micro-steps a window,
# then a smaller micro-batch (1 x 2 x 2 ranks = 4 samples until the batch is set: 4 micro-steps)
SCHEDULE = [(4, 2), (8, 2), (12, 2), (8, 2), (8, 1)]
SAMPLES = sum(train for train, _ in SCHEDULE)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))


def _micro_batch(step: int, micro: int, rank: int, size: int) -> torch.Tensor:
    return torch.randn(size, 6, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _ramp(stage: int, rank: int, tmp: str) -> dict:
    import zeromem.deepspeed as deepspeed

    torch.manual_seed(rank)  # rank 1 starts from other weights: the engine broadcasts rank 0's
    engine, *_ = deepspeed.initialize(model=_net(), config=_config(stage))
    windows, refused = [], ""
    for step, (train, micro_batch) in enumerate(SCHEDULE):
        engine.set_train_micro_batch_size(micro_batch)
        engine.set_train_batch_size(train)  # what Megatron-DeepSpeed calls before each step
        gas = engine.gradient_accumulation_steps()
        assert engine.train_batch_size() == train == micro_batch * gas * WORLD
        for micro in range(gas):
            assert engine.is_gradient_accumulation_boundary() is (micro == gas - 1)
            if (step, micro) == (2, 1):  # a change in the middle of a window is refused
                try:
                    engine.set_train_batch_size(train + 4 * WORLD)
                except ValueError as error:
                    refused = str(error)
            x = _micro_batch(step, micro, rank, micro_batch)
            engine.backward(engine(x).square().mean())
            engine.step()
        windows.append(gas)
    engine.save_checkpoint(f"{tmp}/stage{stage}")
    resumed, *_ = deepspeed.initialize(model=_net(), config=_config(stage))
    resumed.load_checkpoint(f"{tmp}/stage{stage}")
    return {"state": whole_state(engine.engine), "windows": windows, "refused": refused,
            "samples": engine.global_samples, "timer_batch": engine.tput_timer.batch_size,
            "steps": engine.global_steps, "resumed_samples": resumed.global_samples}


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step, (train, micro_batch) in enumerate(SCHEDULE):
        gas = train // (micro_batch * WORLD)
        losses = [net(_micro_batch(step, micro, rank, micro_batch)).square().mean()
                  for micro in range(gas) for rank in range(WORLD)]
        (sum(losses) / len(losses)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _cases(rank: int, world_size: int, tmp: str) -> dict:
    return run_cases(rank, world_size,
                     {f"stage{s}": (lambda r, s=s: _ramp(s, r, tmp)) for s in STAGES})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_distributed(_cases, WORLD, str(tmp_path_factory.mktemp("ramp")))


@pytest.mark.parametrize("stage", STAGES)
def test_ramp_up_trains_as_one_process_on_the_same_batches(ranks, stage):
    reference = _reference()
    for rank, result in enumerate(case(ranks, f"stage{stage}")):
        assert result["windows"] == [1, 2, 3, 2, 4], rank
        assert max_diff(result["state"], reference) < 1e-6, rank
        assert result["samples"] == SAMPLES and result["steps"] == len(SCHEDULE), rank
        assert result["resumed_samples"] == SAMPLES, rank  # the checkpoint keeps the count
        assert result["timer_batch"] == SCHEDULE[-1][0], rank
        assert "cannot change from 3 to 5 in the middle of an accumulation (1 micro-steps" \
            in result["refused"], (rank, result["refused"])
