"""Time gloo collectives on CPU ranks, to pick zeromem's reduce-scatter on gloo.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/bench_collectives.py

For each buffer size S (fp32, default 1, 4 and 16 MB; S is the *full*, unsharded buffer):

* all_reduce            S -> S  (on a copy of the input, so every iteration reduces the same
                                   data; the copy is in the timed region)
* reduce_scatter        S -> S/n  (torch's reduce_scatter_single, formerly reduce_scatter_tensor)
* all_to_all + sum      S -> S/n  (all_to_all_single, then sum the n received chunks locally:
                                   a reduce-scatter built from a personalised exchange)
* all_gather            S/n -> S  (all_gather_single, formerly all_gather_into_tensor)

Operations run round-robin inside each iteration so they share machine noise. Before each
call the ranks meet at a barrier (untimed); an iteration's time is the slower rank's.
Reported: median time, algorithm bandwidth S / t, bus bandwidth (algbw times 2(n-1)/n for
all-reduce, (n-1)/n for the others: the bytes each rank must move at minimum, as
nccl-tests define it), and the bytes the rank actually wrote to its sockets per call
(/proc/self/io wchar) divided by S, against the minimum (n-1)/n or 2(n-1)/n.
The all_to_all + sum result is checked against reduce_scatter's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from measure import bytes_written

HERE = Path(__file__).resolve().parent
MB = 2 ** 20

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single and left the
# old names as deprecated aliases; use whichever this torch has.
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def make_operations(full: torch.Tensor, world: int) -> dict[str, tuple[Callable[[], None], float]]:
    """name -> (call, minimum bytes sent per rank as a multiple of the full buffer)."""
    shard_numel = full.numel() // world
    reduced = torch.empty(full.numel())
    shard_out = torch.empty(shard_numel)
    exchanged = torch.empty(full.numel())
    shard_in = full[:shard_numel].clone()
    gathered = torch.empty(full.numel())

    def all_reduce() -> None:
        reduced.copy_(full)
        dist.all_reduce(reduced)

    def reduce_scatter() -> None:
        REDUCE_SCATTER(shard_out, full)

    def all_to_all_sum() -> None:
        # chunk j of the input goes to rank j; chunk i of the output came from rank i
        dist.all_to_all_single(exchanged, full)
        torch.sum(exchanged.view(world, shard_numel), dim=0, out=shard_out)

    def all_gather() -> None:
        ALL_GATHER(gathered, shard_in)

    share = (world - 1) / world
    return {"all_reduce": (all_reduce, 2 * share), "reduce_scatter": (reduce_scatter, share),
            "all_to_all + sum": (all_to_all_sum, share), "all_gather": (all_gather, share)}


def check_all_to_all_sum(full: torch.Tensor, world: int) -> float:
    """Largest difference between reduce_scatter's and all_to_all + sum's shard."""
    shard_numel = full.numel() // world
    expected = torch.empty(shard_numel)
    REDUCE_SCATTER(expected, full)
    exchanged = torch.empty(full.numel())
    dist.all_to_all_single(exchanged, full)
    actual = exchanged.view(world, shard_numel).sum(dim=0)
    return (expected - actual).abs().max().item()


def time_size(size_bytes: int, iterations: int, warmup: int) -> dict[str, dict[str, float]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    full = torch.randn(size_bytes // 4, generator=generator)  # fp32, S bytes
    operations = make_operations(full, world)
    seconds: dict[str, list[float]] = {name: [] for name in operations}
    sent: dict[str, list[int]] = {name: [] for name in operations}
    for iteration in range(warmup + iterations):
        for name, (call, _) in operations.items():
            dist.barrier()
            written, started = bytes_written(), time.perf_counter()
            call()
            elapsed, written = time.perf_counter() - started, bytes_written() - written
            if iteration >= warmup:
                seconds[name].append(elapsed)
                sent[name].append(written)
    results = {}
    for name, (_, minimum_share) in operations.items():
        per_rank = torch.tensor(seconds[name], dtype=torch.float64)
        dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)  # an iteration takes the slower rank's time
        median = statistics.median(per_rank.tolist())
        algbw = size_bytes / median / 1e9
        bus_factor = minimum_share
        results[name] = {"median_ms": 1e3 * median, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * bus_factor,
                         "sent_per_call_over_size": statistics.median(sent[name]) / size_bytes,
                         "minimum_sent_over_size": minimum_share}
    results["all_to_all + sum"]["max_abs_diff_vs_reduce_scatter"] = check_all_to_all_sum(full, world)
    return results


def format_table(all_results: dict[int, dict[str, dict[str, float]]]) -> str:
    header = ("size", "operation", "median ms", "algbw GB/s", "busbw GB/s", "sent/size", "min")
    lines = [header]
    for size, results in all_results.items():
        for name, r in results.items():
            lines.append((f"{size // MB} MB", name, f"{r['median_ms']:.2f}", f"{r['algbw_GBps']:.2f}",
                           f"{r['busbw_GBps']:.2f}", f"{r['sent_per_call_over_size']:.2f}",
                           f"{r['minimum_sent_over_size']:.2f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in
                      enumerate(zip(line, widths))) for line in lines]
    text.insert(1, "-" * len(text[0]))
    return "\n".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="1,4,16", help="full buffer sizes, MB (fp32)")
    parser.add_argument("--iterations", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "bench_collectives.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    started = time.perf_counter()
    all_results = {int(float(mb) * MB): time_size(int(float(mb) * MB), args.iterations, args.warmup)
                   for mb in args.sizes_mb.split(",")}
    if dist.get_rank() == 0:
        print(f"gloo, {dist.get_world_size()} ranks, torch {torch.__version__}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
              f"{args.iterations} iterations after {args.warmup} warm-up, "
              f"load average {os.getloadavg()[0]:.1f}")
        print(format_table(all_results))
        print("sent/size: bytes this rank wrote to its sockets per call / S;  min: the least any "
              "algorithm must send")
        for size, results in all_results.items():
            diff = results["all_to_all + sum"]["max_abs_diff_vs_reduce_scatter"]
            print(f"{size // MB} MB: all_to_all + sum vs reduce_scatter max |diff| = {diff:.1e}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"world_size": dist.get_world_size(),
                                        "torch": torch.__version__,
                                        "wall_seconds": time.perf_counter() - started,
                                        "results": {str(k): v for k, v in all_results.items()}},
                                       indent=1))
        print(f"JSON: {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
