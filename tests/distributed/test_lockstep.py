"""A collective call made on some ranks only is refused at once, naming it (lockstep.py).

`if rank == 0: engine.save_checkpoint(...)` (and `full_state_dict`, `save_16bit_model`,
`GatheredParameters`, an evaluation forward or a submodule called alone at stage 3) left
the ranks waiting on each other's collectives
until the collective timeout, 10 minutes by default, and then said only that a
collective timed out. Now the rank that comes second to the point where they part
raises RankDivergenceError naming both sides, before it enters a collective; its exit
ends the other's wait. Real gloo worlds of two ranks, one per case (the group does not
survive a divergence). The log itself: a real TCPStore, two sides in this process.
"""
from __future__ import annotations

import datetime
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeromem
import zeromem.deepspeed as zeromem_deepspeed
from harness import free_port, run_distributed
from models import SparseExperts
from zeromem.lockstep import Lockstep, RankDivergenceError

WORLD = 2
TIMEOUT_S = 120  # the harness's limit; a divergence is named within seconds


def engine_for(stage: int, deepspeed: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    config = {"train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if deepspeed:
        return zeromem_deepspeed.initialize(model=model, config=config)[0]
    return zeromem.initialize(model, config)


def rank0_only(rank: int, world_size: int, stage: int, call: str) -> None:
    """Two steps on every rank, then `call` on rank 0 alone, then two more steps."""
    engine = engine_for(stage, deepspeed=call == "deepspeed save_checkpoint")
    directory = tempfile.mkdtemp()
    for step in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        if step == 1 and rank == 0:
            if call.endswith("save_checkpoint"):
                engine.save_checkpoint(directory)
            elif call == "full_state_dict":
                engine.full_state_dict()
            elif call == "save_16bit_model":
                engine.save_16bit_model(directory)
            elif call == "GatheredParameters":  # to print or save the whole weights
                with zeromem.GatheredParameters(list(engine.module.parameters())):
                    pass
            elif call == "submodule":  # an encoder run alone (generate), on rank 0 only
                with torch.no_grad():
                    engine.module[0](x)
            else:  # an evaluation forward on rank 0 alone
                with torch.no_grad():
                    engine(x)


CASES = [(1, "save_checkpoint"), (2, "deepspeed save_checkpoint"), (2, "save_16bit_model"),
         (3, "save_checkpoint"), (3, "full_state_dict"), (3, "GatheredParameters"),
         (3, "evaluation"), (3, "submodule")]


@pytest.mark.parametrize("stage,call", CASES)
def test_a_collective_call_on_rank_0_alone_is_named_at_once(stage, call):
    with pytest.raises(AssertionError) as failed:
        run_distributed(rank0_only, WORLD, stage, call, timeout_s=TIMEOUT_S)
    named = [line for line in str(failed.value).splitlines() if "RankDivergenceError:" in line]
    assert named, str(failed.value)[-3000:]
    name = {"evaluation": "without gradients",
            "submodule": "a gather of '0' outside a forward"}.get(call, call.split()[-1])
    assert name in named[0] and "rank 0" in named[0], named[0]


def experts_apart(rank: int, world_size: int) -> None:
    """A sparse MoE block at stage 3 that is no leaf module: rank 0's samples all pick
    expert 0, rank 1's expert 1, so each rank gathers one expert unit, not the same one, and
    the two all-gathers pair up (before stop 47 each filled its expert with the other's
    shards, silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(SparseExperts(), nn.Linear(4, 2))
    with torch.no_grad():  # the gate picks expert 0 for x[0] > 0, expert 1 below
        model[0].gate.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0]]))
        model[0].gate.bias.zero_()
    engine = zeromem.initialize(model, {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        # merged up to 16 elements only: each expert (20) a unit of its own
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": 16}})
    for step in range(2):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        x[:, 0] = x[:, 0].abs() * (1 - 2 * rank)
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def test_ranks_that_gathered_different_experts_are_stopped_before_the_step():
    """The backward after the forward is refused on the second rank to reach it, naming the
    gathers each launched and the leaf module that would make them agree."""
    with pytest.raises(AssertionError) as failed:
        run_distributed(experts_apart, WORLD, timeout_s=TIMEOUT_S)
    named = [line for line in str(failed.value).splitlines() if "RankDivergenceError:" in line]
    assert named, str(failed.value)[-3000:]
    assert "before event 2 of this engine (backward (micro-step 1, optimizer step 1))" in named[0]
    assert "launched 3 gathers (order" in named[0] and "leaf_module" in named[0], named[0]


def test_sides_that_gathered_differently_are_refused_at_the_next_event():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=10))
    sides = [Lockstep(store, "gathers", rank) for rank in range(2)]
    orders = ["3 gathers (order 0000abcd)"] * 2
    for rank, side in enumerate(sides):
        side.watch(lambda rank=rank: orders[rank])
        side.pass_starts("backward 1")  # the same gathers: agreed
    orders[1] = "3 gathers (order 1111abcd)"
    sides[0].pass_starts("forward 2")
    with pytest.raises(RankDivergenceError) as refused:
        sides[1].pass_starts("forward 2")
    message = str(refused.value)
    assert "before event 2 of this engine (forward 2): since the event before, rank 1 launched " \
           "3 gathers (order 1111abcd), where rank 0 launched 3 gathers (order 0000abcd)" in message
    assert "zero_optimization.leaf_module" in message, message


def test_sides_that_agree_pass_and_the_second_to_differ_names_both():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=10))
    ahead, behind = Lockstep(store, "agree", 0, ring=4), Lockstep(store, "agree", 1, ring=4)
    for n in range(10):  # the slots are reused: ring 4
        ahead.pass_starts(f"backward {n}")
        if n >= 3:  # three events behind, within the ring
            behind.pass_starts(f"backward {n - 3}")
    with ahead.collective("save_checkpoint", "(after step 10)"), \
            ahead.collective("save_checkpoint", "(inside: not an event)"):
        pass
    for n in range(7, 10):
        behind.pass_starts(f"backward {n}")
    with pytest.raises(RankDivergenceError) as refused:
        behind.pass_starts("backward 10")
    message = str(refused.value)
    assert "rank 1 runs backward 10, where rank 0 ran the collective call save_checkpoint " \
           "(after step 10)" in message and "not under `if rank == 0:`" in message, message


def test_a_side_more_than_the_ring_behind_is_never_refused_wrongly():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=10))
    ahead, behind = Lockstep(store, "lapped", 0, ring=4), Lockstep(store, "lapped", 1, ring=4)
    for n in range(9):
        ahead.pass_starts(f"backward {n}")
    for n in range(9):  # slots it finds holding later events are read, not written over
        behind.pass_starts(f"backward {n}")
    ahead.pass_starts("backward 9")
    with pytest.raises(RankDivergenceError):  # and they compare again once it catches up
        behind.pass_starts("forward 9")
