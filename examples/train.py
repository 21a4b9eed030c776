"""Train a small GPT on CPython's own documentation text with zeromem, then print the ledgers.

    torchrun --standalone --nproc_per_node 2 examples/train.py --config examples/configs/stage2.json

Data: the English help text that ships with CPython (`pydoc_data.topics`), as
bytes (vocabulary 256). Each rank draws its own random windows every step.
At the end every rank's memory ledger (measured beside the paper's formula) and
the bytes moved per step are printed, and rank 0 saves them to `--report`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import zeromem  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def load_text() -> torch.Tensor:
    """CPython's pydoc topics as a 1-D tensor of byte values."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def batch(data: torch.Tensor, size: int, seq: int, generator: torch.Generator):
    """`size` random windows: tokens and next-token targets, each (size, seq)."""
    starts = torch.randint(0, len(data) - seq - 1, (size,), generator=generator)
    windows = torch.stack([data[s:s + seq + 1] for s in starts])  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]


def rss_mb() -> float:
    """Peak resident set size of this process, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/configs/stage2.json")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--report", default="runs/demo.json")
    parser.add_argument("--save-dir", default="runs/checkpoints", help="training checkpoints")
    parser.add_argument("--save-every", type=int, default=0, help="steps between checkpoints; 0 = none")
    parser.add_argument("--resume", default="none",
                        help="'auto': continue from --save-dir/latest if it exists (e.g. after "
                             "torchrun --max-restarts relaunched the job); 'none': start fresh")
    parser.add_argument("--checkpoint-activations", action="store_true",
                        help="recompute each block in backward (zeromem.checkpoint)")
    args = parser.parse_args()

    torch.manual_seed(0)  # same initial model on every rank
    shape = GPTConfig(block_size=args.seq, n_layer=args.layers, n_embd=args.width)
    if zeromem.Config.load(args.config).zero_optimization.stage == 3:
        with zeromem.Init():  # stage 3: no rank ever holds the whole model
            model = GPT(shape)
    else:
        model = GPT(shape)
    model.checkpoint_blocks = args.checkpoint_activations
    # stage 3 picks its fetch units (repeated blocks, small neighbours merged); the report
    # below prints the choice; fetch_units=(Block,) would gather one block at a time
    engine = zeromem.initialize(model, args.config)
    rank, world = engine.comm.rank, engine.dp_world_size
    micro, gas = engine.config.train_micro_batch_size_per_gpu, engine.config.gradient_accumulation_steps
    data = load_text()
    start_step = 0
    if args.resume == "auto" and (Path(args.save_dir) / "latest").exists():
        _, client = engine.load_checkpoint(args.save_dir)
        start_step = client["next_step"]
    generator = torch.Generator().manual_seed(1234 + rank)
    if rank == 0:
        print(f"zeromem stage {engine.zero_stage} on {world} ranks: {engine.psi:,} "
              f"parameters, {len(data):,} bytes of text, global batch {micro * gas * world} x {args.seq}")

    bar = tqdm(range(start_step, args.steps), disable=rank != 0, unit="step", mininterval=2.0)
    start, tokens_seen = time.perf_counter(), 0
    for step in bar:
        generator.manual_seed(1234 + 1_000_003 * rank + step)  # same batches after a resume
        for _ in range(gas):
            tokens, targets = batch(data, micro, args.seq, generator)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
        tokens_seen += micro * gas * world * args.seq
        rss = [torch.tensor(rss_mb())]
        if world > 1:
            rss = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(rss, torch.tensor([rss_mb()]), group=engine.comm.group)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_seen / (time.perf_counter() - start):.0f}",
                        rss_mb="/".join(f"{float(r):.0f}" for r in rss))
        if args.save_every and (step + 1) % args.save_every == 0:
            engine.save_checkpoint(args.save_dir, client_state={"next_step": step + 1})

    report, comm = engine.memory_report(), engine.comm_report()
    reports = [None] * world
    if world > 1:
        dist.all_gather_object(reports, report.to_dict(), group=engine.comm.group)
    else:
        reports = [report.to_dict()]
    if rank == 0:
        print(f"\nfinal loss {loss.item():.4f} after {engine.global_steps} steps "
              f"({engine.skipped_steps} skipped)\n")
        print(report)
        if engine.fetch_unit_report:
            print("\n" + engine.fetch_unit_report)
        print("\nper rank: " + ", ".join(
            f"rank {r}: {d['model_state_bytes'] / 1e6:.2f} MB held / "
            f"{d['formula_bytes'] / 1e6:.2f} MB formula"
            for r, d in enumerate(reports)))
        print("\nbytes moved by this rank\n" + str(comm))
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps({
            "config": args.config, "stage": engine.zero_stage, "world_size": world,
            "steps": engine.global_steps, "final_loss": loss.item(),
            "memory": reports, "comm": comm.to_dict(),
            "fetch_units": engine.fetch_unit_report.splitlines()}, indent=2))
        print(f"\nrun ledger saved to {args.report}")
    zeromem.shutdown()  # collectives finished and dropped, then the group ends: a clean exit


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
