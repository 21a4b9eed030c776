"""Train the demo GPT with its optimizer states on NVMe, inside a host-memory budget.

    torchrun --standalone --nproc_per_node 2 examples/train_nvme.py [--host-budget-mb 12]

ZeRO-Infinity's point (arXiv 2104.07857): the fp32 master weights and Adam's two
moments (12 bytes per parameter in bf16 training) need not fit in host memory.
Here they live in swap files under `--nvme-path` (one directory per rank), and
the optimizer step streams them through a pool of `buffer_count` host buffers,
sub-group by sub-group (read the next while stepping this one while writing the
last). The budget sets the sub-group size:

    host bytes = fp32 gradient shard (4 x Psi / N_d)  +  pool (buffer_count x sub_group_size x 4)

so `sub_group_size` is what is left of the budget after the gradient shard,
divided among the pool's buffers. At the end each rank's memory ledger shows the
host bytes within the budget and the optimizer states, larger than the budget,
on NVMe. Data: CPython's pydoc text, as in examples/train.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import zeromem  # noqa: E402
from gpt import GPT, GPTConfig, count_parameters  # noqa: E402
from train import batch, load_text  # noqa: E402

MB = 1e6


def plan_sub_group(config: dict, psi: int, world: int, budget_bytes: float) -> int:
    """The largest sub_group_size whose pool fits in the budget beside the gradient shard."""
    buffers = config["zero_optimization"]["offload_optimizer"]["buffer_count"]
    grads_host = 4 * math.ceil(psi / world)  # fp32 gradient shard copied to host
    alignment = (buffers + 1) * 4096  # each buffer is rounded up to 4 KiB, plus the arena
    left = budget_bytes - grads_host - alignment
    size = int(left // (4 * buffers)) // 1024 * 1024
    if size < 4096:
        raise SystemExit(f"--host-budget-mb {budget_bytes / MB:.1f} is too small: the gradient "
                         f"shard alone takes {grads_host / MB:.1f} MB")
    return size


def host_and_nvme(held: dict) -> tuple[int, int]:
    """(bytes in host memory, optimizer-state bytes on NVMe: master + moments)."""
    host = sum(places.get("host", 0) for places in held.values())
    nvme = sum(held.get(c, {}).get("nvme", 0) for c in ("master_params", "optimizer_states"))
    return host, nvme


def build_engine(args: argparse.Namespace, world: int):
    """The GPT and an engine whose sub-group size fits the host budget."""
    torch.manual_seed(0)  # same initial model on every rank
    model = GPT(GPTConfig(block_size=args.seq, n_layer=args.layers, n_embd=args.width))
    config = json.loads(Path(args.config).read_text())
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    zero = config["zero_optimization"]
    zero["offload_optimizer"]["nvme_path"] = args.nvme_path
    zero["sub_group_size"] = plan_sub_group(config, count_parameters(model), world,
                                            args.host_budget_mb * MB)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"GPT {count_parameters(model):,} parameters on {world} ranks; host budget "
              f"{args.host_budget_mb:.1f} MB/rank -> sub_group_size {zero['sub_group_size']:,}, "
              f"swap files in {args.nvme_path}")
    return zeromem.initialize(model, config)


def train(engine, args: argparse.Namespace) -> None:
    data = load_text()
    rank = engine.comm.rank
    generator = torch.Generator().manual_seed(1234 + rank)
    micro = engine.config.train_micro_batch_size_per_gpu
    start = time.perf_counter()
    for step in range(args.steps):
        tokens, targets = batch(data, micro, args.seq, generator)  # each (B, T)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.3f}  "
                  f"{(time.perf_counter() - start) / (step + 1):.2f} s/step")


def check_ledger(engine, args: argparse.Namespace, world: int) -> None:
    """Print rank 0's ledger and every rank's host / NVMe bytes; assert the budget held."""
    report = engine.memory_report()
    host, nvme = host_and_nvme(report.held)
    rows = [(host, nvme)]
    if world > 1:
        rows = [None] * world
        dist.all_gather_object(rows, (host, nvme), group=engine.comm.group)
    if engine.comm.rank == 0:
        print(f"\n{report}\n")
        for r, (h, n) in enumerate(rows):
            print(f"rank {r}: host {h / MB:.2f} MB <= budget {args.host_budget_mb:.2f} MB; "
                  f"optimizer states on NVMe {n / MB:.2f} MB")
    budget = args.host_budget_mb * MB
    assert host <= budget, f"host bytes {host} exceed the budget {budget:.0f}"
    assert nvme > budget, f"the optimizer states ({nvme} B) would have fit the budget anyway"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).parent / "configs" / "nvme.json"))
    parser.add_argument("--nvme-path", default="/tmp/zeromem-nvme")
    parser.add_argument("--host-budget-mb", type=float, default=12.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    engine = build_engine(args, world)
    train(engine, args)
    check_ledger(engine, args, world)
    engine.close()  # removes this rank's swap directory
    zeromem.shutdown()  # collectives finished and dropped, then the group ends: a clean exit


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
