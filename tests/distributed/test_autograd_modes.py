"""Setups that depend on torch's autograd modes (a stop-43 probe found the first two failing):

- `initialize` and `load_checkpoint` called inside `torch.inference_mode` still make what
  training updates (evaluation under it, stage 3 included: test_user_setups.py);
- a block shared by reentrant activation checkpoints gets a gradient per checkpoint: one
  after its bucket left is refused, naming the parameter and `use_reentrant=False`.

One world of two ranks runs the cases (`run_cases`); every rank is compared.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

import zeromem
from harness import run_distributed
from user_cases import SGD, STAGES, WORLD, batch, case, config, max_diff, mlp, run_cases, \
    train_step, whole_state


def initialized_in_inference_mode(rank: int) -> dict:
    """initialize, and a load_checkpoint, called inside torch.inference_mode (a script that
    sets up, or restores, under its evaluation's context): what they make is still what
    training can update. A step is taken, undone by the load, and taken again."""
    out = {}
    for stage in STAGES:
        model = mlp()
        with torch.inference_mode():
            engine = zeromem.initialize(model, {**config(stage, "fp32"), "optimizer": SGD})
        for step in range(2):
            train_step(engine, step, rank)
        path = [tempfile.mkdtemp() if rank == 0 else None]
        torch.distributed.broadcast_object_list(path)
        engine.save_checkpoint(path[0])
        train_step(engine, 2, rank)
        with torch.inference_mode():
            engine.load_checkpoint(path[0])
        train_step(engine, 2, rank)
        out[stage] = whole_state(engine)
    return out


class SharedBlock(nn.Module):
    """One block used three times, each in a reentrant activation checkpoint (HF's ALBERT
    with gradient_checkpointing, whose default is use_reentrant=True)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.reentrant = reentrant

    def forward(self, x):
        x = self.inp(x)  # the checkpoints' inputs need gradients
        for _ in range(3):
            x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.out(torch.tanh(x))


def reentrant_shared_block(rank: int) -> dict:
    """Each checkpoint's backward gives the shared block another gradient after its bucket
    (of one parameter) left: refused, naming the parameter and the non-reentrant fix, which
    then trains."""
    out = {}
    for stage in (2, 3):
        for reentrant in (True, False):
            torch.manual_seed(4)
            cfg = config(stage, "fp32")
            cfg["zero_optimization"]["reduce_bucket_size"] = 6  # a bucket a parameter
            engine = zeromem.initialize(SharedBlock(reentrant), {**cfg, "optimizer": SGD})
            try:
                engine.backward(engine(batch(0, rank)).pow(2).mean())
                engine.step()
                out[stage, reentrant] = "trained"
            except RuntimeError as error:
                out[stage, reentrant] = str(error)
    return out


CASES = {"reentrant": reentrant_shared_block, "inference_mode": initialized_in_inference_mode}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(run_cases, WORLD, CASES)


def test_a_second_gradient_after_the_reduction_names_the_parameter_and_the_fix(ranks):
    for rank, got in enumerate(case(ranks, "reentrant")):
        for stage in (2, 3):
            who = "parameter 'block." if stage == 2 else "parameter of unit 'block' "
            assert got[stage, True].startswith(who), (rank, got)
            assert "received a second gradient" in got[stage, True], (rank, got)
            assert "use_reentrant=False" in got[stage, True], (rank, got)
            assert got[stage, False] == "trained", (rank, stage, got)


def test_engines_set_up_and_restored_under_inference_mode_train_like_one_process(ranks):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.cat([batch(step, r) for r in range(WORLD)])
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank, got in enumerate(case(ranks, "inference_mode")):
        for stage, state in got.items():
            assert max_diff(state, model.state_dict()) < 1e-6, (rank, stage)
