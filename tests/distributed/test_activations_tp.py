"""The tensor-parallel layers and partitioned activations (Pa, Pa+cpu, Pa+MD) on real groups:
one spawned world of 4 gloo ranks runs every case (TP parity, Pa combinations, 2x2 groups).
The single-process activation checkpointing tests are tests/unit/test_activations.py.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harness import run_distributed
from models import StorageTracker, assert_all_close, grads_of
from zeromem.activations import recompute as act
from zeromem.activations.recompute import checkpoint


class TPBlock(nn.Module):
    """Megatron MLP: column-parallel up, row-parallel down, dropout on the replicated output."""

    def __init__(self, hidden: int, group):
        super().__init__()
        from zeromem.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        self.fc1 = ColumnParallelLinear(hidden, 4 * hidden, group)
        self.fc2 = RowParallelLinear(4 * hidden, hidden, group)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(x))))


def _check_tp_parity(group, rank: int, size: int) -> None:
    from zeromem.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    torch.manual_seed(5)
    dense = nn.Linear(6, 8)
    torch.manual_seed(5)
    seeded = ColumnParallelLinear(6, 8, group)  # same seed -> the same full weight, sliced
    rows = slice(rank * 8 // size, (rank + 1) * 8 // size)
    assert torch.equal(seeded.weight, dense.weight[rows])
    assert torch.equal(seeded.bias, dense.bias[rows])

    torch.manual_seed(1)
    up, down, up2, down2 = nn.Linear(6, 8), nn.Linear(8, 6), nn.Linear(6, 8), nn.Linear(8, 6)
    tp = nn.ModuleList([ColumnParallelLinear.from_dense(up, group),
                        RowParallelLinear.from_dense(down, group),
                        ColumnParallelLinear.from_dense(up2, group, gather_output=True),
                        RowParallelLinear.from_dense(down2, group, input_is_parallel=False)])
    x = torch.randn(5, 6, requires_grad=True)
    weights = torch.randn(5, 6)
    ref = down2(torch.tanh(up2(down(torch.tanh(up(x))))))
    out = tp[3](torch.tanh(tp[2](tp[1](torch.tanh(tp[0](x))))))
    torch.testing.assert_close(out, ref)
    (ref * weights).sum().backward()
    x_grad, x.grad = x.grad.clone(), None
    (out * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_grad)
    cols = slice(rank * 8 // size, (rank + 1) * 8 // size)
    for column, dense_up in ((tp[0], up), (tp[2], up2)):
        torch.testing.assert_close(column.weight.grad, dense_up.weight.grad[rows])
        torch.testing.assert_close(column.bias.grad, dense_up.bias.grad[rows])
    for row, dense_down in ((tp[1], down), (tp[3], down2)):
        torch.testing.assert_close(row.weight.grad, dense_down.weight.grad[:, cols])
        torch.testing.assert_close(row.bias.grad, dense_down.bias.grad)


_COMBOS = {"plain": None, "ckpt": {}, "Pa": {"partition_activations": True},
           "Pa+cpu": {"partition_activations": True, "cpu_checkpointing": True},
           "Pa+MD": {"partition_activations": True, "contiguous_memory_optimization": True},
           "Pa+cpu+MD": {"partition_activations": True, "cpu_checkpointing": True,
                         "contiguous_memory_optimization": True}}


def _run_pa_combos(group, layers: int, hidden: int, batch: int) -> dict:
    """Grads and held checkpoint bytes of each combination on one TP model."""
    torch.manual_seed(0)
    model = nn.ModuleList(TPBlock(hidden, group) for _ in range(layers))
    x = torch.randn(batch, hidden, requires_grad=True)
    out = {}
    for name, options in _COMBOS.items():
        act.configure(mp_group=group, number_checkpoints=layers, **(options or {}))
        torch.manual_seed(42)
        tracker = StorageTracker()
        with tracker:
            h = x
            for block in model:
                h = block(h) if options is None else checkpoint(block, h)
            loss = h.pow(2).sum()
        del h
        alive = tracker.settled_held_bytes(exclude=[x, *model.parameters()])
        stats = act.checkpoint_stats()
        loss.backward()
        assert act.held_checkpoint_bytes() == 0
        out[name] = (grads_of(x, model), (stats, alive))
    act.configure()
    return out


def _world_of_four(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from zeromem.tensor_parallel import make_2d_groups
    dp_group, mp_group = make_2d_groups(2, 2)
    _, mp4 = make_2d_groups(1, 4)
    assert dist.get_process_group_ranks(mp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(dp_group) == [rank % 2, rank % 2 + 2]
    assert dist.get_process_group_ranks(mp4) == [0, 1, 2, 3]
    _check_tp_parity(mp_group, dist.get_rank(mp_group), 2)
    _check_tp_parity(mp4, rank, 4)
    # hidden 63 x batch 33: 2079 elements per checkpoint, padded to 2080 (N=2) and 2080 (N=4)
    layers, hidden, batch = 4, 63, 33
    result = {}
    for n, group in ((2, mp_group), (4, mp4)):
        runs = _run_pa_combos(group, layers, hidden, batch)
        for name, (grads, _) in runs.items():
            assert_all_close(runs["plain"][0], grads)
        result[n] = {name: stats for name, (_, stats) in runs.items()}
    return result


def test_tensor_parallel_and_partitioned_activations_world_of_four():
    results = run_distributed(_world_of_four, 4)
    layers, numel = 4, 33 * 63
    for n, measured in results[0].items():
        runs = {name: stats for name, (stats, _) in measured.items()}
        alive = {name: nbytes for name, (_, nbytes) in measured.items()}
        whole = layers * numel * 4
        shard = layers * math.ceil(numel / n) * 4
        print(f"N_mp={n}: ledger", {k: s.held_bytes for k, s in runs.items()}, "alive bytes", alive)
        # What is really alive between forward and backward: the stored checkpoints (the
        # whole MD pool when it is on; block inputs 2..4 without Pa, x being the caller's),
        # the last output (saved by the loss's pow) and the loss.
        last = numel * 4
        assert alive["plain"] > 4 * whole
        assert 3 * last + last <= alive["ckpt"] <= whole + last
        for name in ("Pa", "Pa+cpu"):
            assert shard + last <= alive[name] <= shard + last + 64
        for name in ("Pa+MD", "Pa+cpu+MD"):
            assert alive[name] <= runs[name].total_pool_bytes + last + 64
        assert runs["ckpt"].held_bytes == {"device": whole, "host": 0}
        assert runs["Pa"].held_bytes == {"device": shard, "host": 0}
        assert runs["Pa+cpu"].held_bytes == {"device": 0, "host": shard}
        assert runs["Pa+MD"].held_bytes["device"] == shard
        pool = layers * 64 * math.ceil(shard / layers / 64)  # slots start on 64-byte boundaries
        assert runs["Pa+MD"].pool_bytes == {"device": pool, "host": 0}
        assert runs["Pa+cpu+MD"].pool_bytes == {"device": 0, "host": pool}
        assert runs["Pa+cpu+MD"].held_bytes == {"device": 0, "host": shard}
        assert whole / runs["Pa"].total_held_bytes >= n * numel / (numel + n)  # ~N_mp, less padding
        estimate = act.estimate_checkpoint_bytes(1, numel, bytes_per_element=4, mp_size=n)
        assert shard == layers * estimate
