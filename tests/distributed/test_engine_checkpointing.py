"""zeromem.checkpoint inside a model trained by the engine: same numbers as without it."""
from __future__ import annotations

import copy

import torch

import zeromem
from harness import run_distributed
from models import Reference, TinyLM, micro_batch, state_dict_diff, uses_sometimes
from setups import parity_config


def checkpointed_parity(rank, world_size):
    out = {}
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        model = TinyLM()
        ref = Reference(copy.deepcopy(model), per_rank=stage < 3)
        model.checkpointed = True
        extra = {"activation_checkpointing": {"partition_activations": False,
                                              "cpu_checkpointing": True}}
        engine = zeromem.initialize(model, parity_config(stage, 2, 0.0, world_size, **extra))
        edge_untouched = not zeromem.checkpointing.get_config().cpu_checkpointing
        for step in range(2):
            for micro in range(2):
                tokens, targets = micro_batch(step, rank, micro)
                engine.backward(engine(tokens, targets,
                                       uses_sometimes(step, rank, micro, stage < 3)))
                engine.step()
            ref.step(step, world_size, 2)
        held = engine.memory_report().held.get("activation_checkpoints", {})
        out[stage] = (state_dict_diff(engine.full_state_dict(), ref.model), held,
                      edge_untouched, outside_an_engine())
    return out


def outside_an_engine() -> dict[str, int]:
    """Bytes a checkpoint called outside any engine stores: under the default policy."""
    x = torch.ones(64, requires_grad=True)
    y = zeromem.checkpoint(torch.sin, x)
    held = {place: zeromem.checkpointing.held_checkpoint_bytes(place)
            for place in ("device", "host")}
    y.sum().backward()
    return held


def test_checkpointed_model_trains_like_the_reference():
    for stage, (diff, held, edge_untouched, outside) in \
            run_distributed(checkpointed_parity, 2)[0].items():
        assert diff <= 1e-5, (stage, diff)
        assert held.get("host", 0) > 0 and held.get("device", 0) == 0, held  # Pa+cpu: on host
        # the engine's policy is its own: initialize leaves the configure() default alone
        assert edge_untouched, stage
        assert outside == {"device": 64 * 4, "host": 0}, outside
