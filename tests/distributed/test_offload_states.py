"""`offload_states` / `reload_states` (DeepSpeed's engine API; offload/states.py): OpenRLHF's
colocated RLHF (`--deepspeed_enable_sleep`) frees the trainer's GPU memory this way while
vLLM generates, and until this test zeromem had neither (an AttributeError).

One spawned world of 2 gloo ranks, seeded apart, trains at stages 0-3 in bf16 (so the fp32
masters are tensors of their own) with two micro-steps a window. Midway, mid-accumulation
too, it offloads every state kind, checks that their storages on the device are empty and
that backward is refused, reloads, and trains on; every rank's weights must equal, bit for
bit, those of an engine trained the same way without the round trip. On the CPU the device
is the host, so the round trip is a copy and a free; tests/gpu/test_cuda.py checks the
device memory it gives back.
"""
from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from user_cases import STAGES, WORLD, case, run_cases, whole_state

GAS, STEPS = 2, 3


def _config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  **zero}}


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def _micro_step(engine, step: int, micro: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    x = torch.randn(2, 6, generator=g).to(torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    engine.step()


def _held(engine) -> list[torch.Tensor]:
    """The tensors offload_states moves: optimizer states, masters, gradient buffers."""
    native = engine.engine
    states = [t for s in native.optimizer.state.values() for t in s.values()
              if torch.is_tensor(t) and t.numel() > 1]
    return states + [g.master for g in native.groups] + \
        [t for g in native.groups for t in g.grad_held()]


def _train(stage: int, rank: int, round_trip: bool) -> dict:
    import zeromem.deepspeed as deepspeed
    from zeromem.deepspeed.zero import OffloadDeviceEnum, OffloadStateTypeEnum

    torch.manual_seed(rank)
    engine, *_ = deepspeed.initialize(model=_net(), config=_config(stage))
    freed, refused = [], ""
    for step in range(STEPS):
        for micro in range(GAS):
            if round_trip and (step, micro) in ((1, 0), (1, 1)):  # between steps, mid-window
                # OpenRLHF's offload_deepspeed_states / reload_deepspeed_states
                engine.optimizer.offload_states(
                    include=[OffloadStateTypeEnum.optim_states,
                             OffloadStateTypeEnum.contiguous_grad_buffer,
                             OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads],
                    device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
                engine.empty_partition_cache()
                freed.append(max(t.untyped_storage().nbytes() for t in _held(engine)))
                try:
                    _micro_step(engine, step, micro, rank)
                except RuntimeError as error:
                    refused = str(error)
                engine.reload_states(non_blocking=True)
            _micro_step(engine, step, micro, rank)
    return {"state": whole_state(engine.engine), "freed": freed, "refused": refused}


def _refusals(rank: int) -> dict:
    import zeromem.deepspeed as deepspeed

    engine, *_ = deepspeed.initialize(model=_net(), config=_config(2))
    messages = {}
    for name, call in {
            "lp_params": lambda: engine.offload_states(include=["lp_params"]),
            "nvme": lambda: engine.offload_states(device="nvme"),
            "twice": lambda: (engine.offload_states(), engine.offload_states())}.items():
        try:
            call()
        except (NotImplementedError, ValueError, RuntimeError) as error:
            messages[name] = str(error)
    engine.reload_states()
    offloaded, *_ = deepspeed.initialize(model=_net(), config=_config(
        2, offload_optimizer={"device": "cpu"}))
    try:
        offloaded.offload_states()
    except NotImplementedError as error:
        messages["offload_optimizer"] = str(error)
    return messages


def _cases(rank: int, world_size: int) -> dict:
    cases = {f"{s}-{trip}": (lambda r, s=s, trip=trip: _train(s, r, trip))
             for s in STAGES for trip in (False, True)}
    return run_cases(rank, world_size, {**cases, "refusals": _refusals})


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_cases, WORLD)


@pytest.mark.parametrize("stage", STAGES)
def test_a_round_trip_between_steps_and_mid_window_changes_nothing(ranks, stage):
    for rank, (plain, trip) in enumerate(zip(case(ranks, f"{stage}-False"),
                                             case(ranks, f"{stage}-True"))):
        assert trip["freed"] == [0, 0], rank  # every storage emptied, twice
        assert "offload_states" in trip["refused"] and "reload_states()" in trip["refused"]
        for key, value in plain["state"].items():
            assert torch.equal(value, trip["state"][key]), (rank, key)


def test_what_is_not_moved_is_refused_by_name(ranks):
    for messages in case(ranks, "refusals"):
        assert "lp_params" in messages["lp_params"] and "parameters" in messages["lp_params"]
        assert "nvme" in messages["nvme"]
        assert "reload_states()" in messages["twice"]
        assert "offload_optimizer" in messages["offload_optimizer"]
