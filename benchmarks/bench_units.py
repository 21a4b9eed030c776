"""Stage-3 fetch units, default against hand-picked, measured side by side in one process pair.

    OMP_NUM_THREADS=1 python benchmarks/bench_units.py [--models hf-gpt2,hf-llama,deep]
        [--rounds 30] [--profile SYSTEM:MODEL [--clock thread] [--stats FILE]]

On a shared, noisy machine separate trials see different loads (issue 15: one such run
put zeromem-3 at 3.31x DDP on HF GPT-2 and block units at 2.05x, where side by side the
two are within noise); here every system is built once per model in the same two gloo
workers, and the rounds interleave them step by step (the order rotated each round), so
a burst of load hits all alike. Systems: `ddp` (DistributedDataParallel + AdamW),
`z3-default` (zeromem stage 3, fetch units chosen by zeromem), `z3-blocks`
(fetch_units=(block class,)). Per step it records wall time (the slower rank's) and CPU
time (rank 0's process time, every thread), the work a step does, which load changes
less than wall time (it still moves: caches, frequency). Printed: medians, the ratios
to DDP's, the load average before and after. With `--profile`, a cProfile of rank 0
over the timed steps of one system: a per-category breakdown (`BREAKDOWN`: stage-3
hooks, gradient hooks, collective launches and waits, the step's phases) and the top
functions; `--clock thread` profiles the main thread's CPU time instead of wall time
(waits then cost nothing; cProfile's own cost inflates Python-heavy rows either way).
Models and systems come from bench_models.py.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_models as bm  # noqa: E402

SYSTEMS = ["ddp", "z3-default", "z3-blocks"]


# (label, file suffix, function name): cumulative time of these entry points, per step.
# Nested rows are parts of the row above them; "rest" rows are what the parts leave.
BREAKDOWN = [
    ("forward", "zeromem/engine.py", "forward"),
    ("  stage-3 forward hooks (gather, order, release)", "stage3/fetch.py",
     ("_start_forward", "_pre_forward", "_post_forward")),
    ("backward", "zeromem/engine.py", "backward"),
    ("  autograd engine (C++ backward ops)", "~", "<method 'run_backward' of "
     "'torch._C._EngineBase' objects>", "tottime"),
    ("  gradient hooks: add into bucket", "zeromem/zero_optimizer.py", "accumulate"),
    ("  gradient hooks: launch reduce-scatter", "zeromem/zero_optimizer.py", "_launch_ready"),
    ("  gradient hooks: all", "zeromem/zero_optimizer.py", "on_grad"),
    ("  stage-3 unit gradient hooks: all (count, last one reduces)", "stage3/sharded_unit.py",
     "_grad_in"),
    ("    of which into the bucket (one copy per unit)", "stage3/sharded_unit.py",
     "_fill_bucket"),
    ("  stage-3 re-gather before backward", "stage3/fetch.py", "before_backward"),
    ("  wait for the last reductions", "zeromem/zero_optimizer.py", "finish_backward"),
    ("step", "zeromem/engine.py", "step"),
    ("  grad norm (+ all-reduce)", "zeromem/zero_optimizer.py", "_global_grad_norm"),
    ("  unscale into masters", "zeromem/zero_optimizer.py", "_unscale_into_masters"),
    ("  parameter all-gather + stage-3 refresh", "zeromem/zero_optimizer.py", "gather_params"),
    ("    of which refresh (persistent units)", "stage3/fetch.py", "refresh"),
    ("  zero_grad", "zeromem/engine.py", "zero_grad"),
    ("collective waits (anywhere)", "~", "<built-in method torch._C._distributed_c10d.wait>",
     "tottime"),
    ("collective launches (anywhere)", "~", ("<built-in method torch._C._distributed_c10d."
     "all_to_all_single>", "<built-in method torch._C._distributed_c10d.all_gather_single>",
     "<built-in method torch._C._distributed_c10d.allreduce>"), "tottime"),
    ("torch.compiler.disable wrappers", "torch/_dynamo/eval_frame.py", "_fn", "tottime"),
]


def breakdown(stats: pstats.Stats, steps: int) -> str:
    """Milliseconds per step of each BREAKDOWN row (cumulative, or own time where marked)."""
    table = stats.stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    lines = []
    for label, suffix, names, *how in BREAKDOWN:
        names = names if isinstance(names, tuple) else (names,)
        column = 2 if how == ["tottime"] else 3
        total = sum(v[column] for (f, _, n), v in table.items()
                    if f.endswith(suffix) and n in names)
        lines.append(f"  {label:<52} {1e3 * total / steps:8.2f}")
    return "\n".join(lines)


def build(system: str, name: str):
    model, blocks, block_class = bm.build_model(name)
    loss = bm.loss_fn(name)
    mapped = {"ddp": "ddp", "z3-default": "zeromem-3", "z3-blocks": "zeromem-3-blocks"}
    return bm.build_system(mapped[system], model, blocks, block_class, loss)


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    load_before = os.getloadavg()
    for name in args.models.split(","):
        steps = {s: build(s, name) for s in args.systems.split(",")}
        data = bm.batches(name, rank, 3)
        wall: dict[str, list[float]] = {s: [] for s in steps}
        cpu: dict[str, list[float]] = {s: [] for s in steps}
        clock = time.thread_time if args.clock == "thread" else time.perf_counter
        prof = cProfile.Profile(clock) if rank == 0 and args.profile else None
        order = list(steps)
        for r in range(args.warmup + args.rounds):
            order = order[1:] + order[:1]
            for system in order:
                dist.barrier()
                profiling = prof is not None and r >= args.warmup and \
                    args.profile == f"{system}:{name}"
                c0, t0 = time.process_time(), time.perf_counter()
                if profiling:
                    prof.enable()
                steps[system](data[r % len(data)])
                if profiling:
                    prof.disable()
                took = torch.tensor(time.perf_counter() - t0)
                used = time.process_time() - c0
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if r >= args.warmup:
                    wall[system].append(float(took))
                    cpu[system].append(used)
        if rank == 0:
            base_w, base_c = statistics.median(wall["ddp"]), statistics.median(cpu["ddp"])
            print(f"\n{name}: {args.rounds} interleaved rounds")
            print(f"  {'system':<12} {'wall ms':>8} {'/DDP':>6} {'cpu ms':>8} {'/DDP':>6}")
            for s in steps:
                w, c = statistics.median(wall[s]), statistics.median(cpu[s])
                print(f"  {s:<12} {1e3 * w:8.1f} {w / base_w:6.2f} {1e3 * c:8.1f} {c / base_c:6.2f}")
            if prof is not None and args.profile.endswith(f":{name}"):
                if args.stats:
                    prof.dump_stats(args.stats)
                print(f"per step, ms ({args.clock} clock), {args.profile}:")
                print(breakdown(pstats.Stats(prof), args.rounds))
                for key in ("cumulative", "tottime") if args.top else ():
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
                    print(out.getvalue())
    if rank == 0:
        print(f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="hf-gpt2,hf-llama,deep")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", default="", help="SYSTEM:MODEL, e.g. z3-default:hf-gpt2")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--stats", help="also write the profile here (pstats format)")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="the profile's clock: wall time, or the main thread's CPU time")
    args = parser.parse_args()
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(args, bm.free_port()), nprocs=2, join=True)


if __name__ == "__main__":
    main()
