"""ZeRO over data parallelism x Megatron tensor parallelism, with Pa over the model-parallel group.

    torchrun --standalone --nproc_per_node 4 examples/train_tp.py --dp 2 --mp 2

Ranks form a dp x mp grid (model-parallel fastest). Each block's MLP is split
column/row-parallel over the mp group; ZeRO shards optimizer states and
gradients over the dp group; each block runs under `zeromem.checkpoint`, whose
stored input is partitioned over the mp group (Pa: every mp rank holds the same
activation, so each keeps 1/N_mp) and, with --cpu, kept in host memory (Pa+cpu).
Prints the held checkpoint bytes with and without Pa and the memory ledger.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import zeromem  # noqa: E402
from train import batch, load_text  # noqa: E402
from zeromem.tensor_parallel import ColumnParallelLinear, RowParallelLinear, make_2d_groups  # noqa: E402


class TPBlock(nn.Module):
    """Pre-LN residual MLP block, Megatron style: column-parallel up, row-parallel down."""

    def __init__(self, width: int, mp_group) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = ColumnParallelLinear(width, 4 * width, mp_group)    # (B, T, 4C / N_mp)
        self.down = RowParallelLinear(4 * width, width, mp_group)     # all-reduce -> (B, T, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TPModel(nn.Module):
    """Byte-level LM: embedding, `layers` tensor-parallel blocks, tied head. Returns the loss."""

    def __init__(self, width: int = 128, layers: int = 4, mp_group=None, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(TPBlock(width, mp_group) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        nn.init.normal_(self.embed.weight, std=0.02)  # small logits from the tied head at start
        self.checkpoint_blocks = True

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)                                        # (B, T, C)
        for block in self.blocks:
            x = zeromem.checkpoint(block, x) if self.checkpoint_blocks else block(x)
        logits = F.linear(self.ln(x), self.embed.weight)              # (B, T, V), tied
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--mp", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--cpu", action="store_true", help="Pa+cpu: checkpoints in host memory")
    args = parser.parse_args()

    zeromem.distributed.ensure_process_group()
    dp_group, mp_group = make_2d_groups(args.dp, args.mp)
    dp_rank, rank = dist.get_rank(dp_group), dist.get_rank()
    torch.manual_seed(0)  # the same dense weights everywhere; each mp rank keeps its slice
    model = TPModel(mp_group=mp_group)
    zeromem.checkpointing.configure(mp_group=mp_group, partition_activations=True,
                                    cpu_checkpointing=args.cpu)
    engine = zeromem.initialize(model, {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": args.stage}}, dp_group=dp_group)
    data = load_text()
    generator = torch.Generator().manual_seed(dp_rank)  # mp ranks of one dp slot share data
    held = {}
    for step in range(args.steps):
        tokens, targets = batch(data, 8, args.seq, generator)
        engine.activation_checkpointing.reset_peak()
        loss = engine(tokens, targets)
        held["pa"] = engine.activation_checkpointing.stats().held_bytes
        engine.backward(loss)
        engine.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    full = args.seq * 8 * model.embed.embedding_dim * 4 * len(model.blocks)  # fp32 inputs
    if rank == 0:
        print(f"\n{args.dp} x {args.mp} (dp x mp), ZeRO stage {args.stage} over dp, Pa over mp")
        print(f"checkpointed inputs between forward and backward: {dict(held['pa'])} bytes "
              f"(without Pa: {full} bytes, 1/N_mp = {full // args.mp})")
        print(engine.memory_report())
    zeromem.shutdown()  # collectives finished and dropped, then the group ends: a clean exit


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
