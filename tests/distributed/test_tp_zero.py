"""ZeRO over data parallelism x tensor parallelism with Pa: trains like one dense process."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import zeromem
from harness import run_distributed
from train_tp import TPModel
from zeromem.activations.recompute import estimate_checkpoint_bytes
from zeromem.tensor_parallel import make_2d_groups


def batches(step: int, dp_rank: int):
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    tokens = torch.randint(0, 256, (4, 16), generator=g)
    return tokens, torch.randint(0, 256, (4, 16), generator=g)


CLIP = 0.5  # below the gradient norm (about 0.77 at the start): every step clips
SHARDED = ("up.weight", "up.bias", "down.weight")  # split across mp ranks; the rest is replicated


def _deepspeed_with_mpu(model, config, dp_group, mp_group):
    """Megatron's way in: `deepspeed.initialize(mpu=...)`; the native engine it wraps."""
    import types

    import zeromem.deepspeed as deepspeed
    mpu = types.SimpleNamespace(get_data_parallel_group=lambda: dp_group,
                                get_model_parallel_group=lambda: mp_group,
                                get_pipeline_model_parallel_world_size=lambda: 1)
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    assert (engine.world_size, engine.dp_world_size, engine.mp_world_size) == (4, 2, 2)
    assert engine.global_rank == dist.get_rank()
    return engine.engine


def tp_zero_vs_dense(rank, world_size, stage, cpu, mp_group_from):
    dp_group, mp_group = make_2d_groups(2, 2)
    dp_rank = dist.get_rank(dp_group)
    torch.manual_seed(0)
    dense = TPModel(width=32, layers=2)  # no group: the same weights, whole
    dense.checkpoint_blocks = False
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    model = TPModel(width=32, layers=2, mp_group=mp_group)
    zeromem.checkpointing.configure(mp_group=mp_group, partition_activations=True,
                                    cpu_checkpointing=cpu)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if mp_group_from == "mpu":
        engine = _deepspeed_with_mpu(model, config, dp_group, mp_group)
    else:  # "checkpointing": the activation-checkpointing mp group configured above
        engine = zeromem.initialize(model, config, dp_group=dp_group,
                                    **({"mp_group": mp_group} if mp_group_from == "argument" else {}))
    diffs, held, norms = [], [], []
    for step in range(3):
        loss = engine(*batches(step, dp_rank))
        held.append(engine.activation_checkpointing.held_bytes())
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        ref_losses = [dense(*batches(step, d)) for d in range(2)]
        (sum(ref_losses) / 2).backward()
        true_norm = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP))
        opt.step()
        diffs.append(abs(loss.item() - ref_losses[dp_rank].item()))
        norms.append((engine.get_global_grad_norm(), true_norm))
    zeromem.checkpointing.configure()
    with tempfile.TemporaryDirectory() as tmp:  # files named by dp rank: mp ranks would clash
        with pytest.raises(NotImplementedError, match="tensor parallelism"):
            engine.save_checkpoint(tmp)
        assert not os.listdir(tmp)  # refused before anything was written
    full = engine.full_state_dict()  # on dp rank 0 of each mp rank: global ranks 0 and 1
    # plain lists: tensors sent back through the queue would share memory with a dead rank
    replicated = {k: v.tolist() for k, v in full.items() if not k.endswith(SHARDED)}
    return diffs, held, norms, replicated


# (stage, Pa+cpu, where the engine's mp group comes from)
CASES = [(2, False, "argument"), (3, True, "checkpointing"), (3, False, "mpu")]


def every_case(rank, world_size):
    """Both cases in one world of four: spawning it costs more than a case."""
    return [tp_zero_vs_dense(rank, world_size, *case) for case in CASES]


@pytest.fixture(scope="module")
def cases() -> list:
    return run_distributed(every_case, 4)


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_tp_with_zero_and_pa_matches_dense(cases, case):
    # the seed's estimator at this small scale: one fp32 (B=4, T=16, C=32) input per block
    per_block = estimate_checkpoint_bytes(seq=16, hidden=32, batch=4, bytes_per_element=4, mp_size=2)
    results = [per_rank[case] for per_rank in cases]
    for diffs, held, norms, _ in results:
        # clipping uses the dense model's norm on every rank (mp group spanned, replicated once)
        assert all(abs(norm - true) < 1e-5 * true for norm, true in norms), norms
        assert max(diffs) < 1e-5, diffs
        assert held[0] == 2 * per_block == 4 * 16 * 32 * 4  # two blocks, each halved by Pa
    mp0, mp1 = results[0][3], results[1][3]  # the two model-parallel ranks of dp rank 0
    assert mp0.keys() == mp1.keys() and "embed.weight" in mp0
    assert all(mp0[k] == mp1[k] for k in mp0), "replicated parameters drifted apart"
