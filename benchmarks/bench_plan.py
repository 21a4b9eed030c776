"""Predicted against measured step time: `zeromem plan --calibrate` on this machine.

    python benchmarks/bench_plan.py [--nvme-path DIR] [--steps 5] [--out results/plan.json]

1. Calibrate (planning/calibrate.py): the demo GPT's forward and backward, the
   gloo collectives through the engine's Comm, copies, swap I/O and AdamW's step,
   on 2 spawned ranks (the same figures `zeromem plan --calibrate` measures).
2. Predict each setup's step with the planner (`evaluate` with the calibration),
   from the config the planner writes for it (`deepspeed_config`).
3. Measure: each setup's engine built from that config on 2 gloo ranks, all alive
   at once and stepped in turn, the median over `--steps` timed steps (after 2
   warm-up steps) of barrier-to-barrier time. The calibration's samples are taken
   in the same rounds (`calibrate.Probe`), so that load from other processes on a
   shared machine falls on calibration and steps alike.

Prints predicted vs measured per setup and, for every pair of setups whose
predictions differ by more than 10 %, whether the measured ratio points the same
way. On a shared machine the measured figures move by 10-20 % from run to run;
the table is one run.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

from zeromem.planning.calibrate import (Measurement, Probe, from_samples,  # noqa: E402
                                        measurement, run_ranks)
from zeromem.planning.planner import (Hardware, Setup, Workload, deepspeed_config,  # noqa: E402
                                      evaluate, shape_of)

SETUPS = [Setup(0), Setup(1), Setup(2), Setup(3), Setup(2, "none", "cpu"),
          Setup(2, "none", "nvme"), Setup(3, "none", "cpu", "cpu"),
          Setup(3, "none", "nvme", "nvme")]


def _measure(rank: int, world: int, configs: dict, gpt: GPTConfig, what: Measurement,
             steps: int) -> tuple[list[dict], dict[str, list[float]]]:
    """Calibration samples and each engine's step times, taken in the same rounds."""
    import torch.distributed as dist

    import zeromem
    probe = Probe(what, rank)
    engines = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        engines[name] = zeromem.initialize(GPT(gpt), config)
    x = torch.randint(0, gpt.vocab_size, (what.micro_batch, what.seq))
    times: dict[str, list[float]] = {name: [] for name in configs}
    samples = []
    for i in range(steps + 2):
        if i >= 2:
            samples.append(probe.sample())
        for name, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            engine.backward(engine(x, x))
            engine.step()
            dist.barrier()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    for engine in engines.values():
        engine.close()
    probe.close()
    return samples, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    gpt, world = GPTConfig(), 2
    with torch.device("meta"):
        shape = shape_of(GPT(gpt), name="demo GPT")
    work = Workload(args.micro_batch, args.seq, 1, "fp32")
    what = measurement(functools.partial(GPT, gpt), shape, args.micro_batch, args.seq, world,
                       args.nvme_path)
    # the planner's config for each setup: its layout does not depend on the calibration
    draft = Hardware(world, 1e12)
    candidates = {s.label(): evaluate(shape, s, draft, work) for s in SETUPS}
    configs = {name: deepspeed_config(c, shape, work, world, args.nvme_path)
               for name, c in candidates.items()}
    started = time.perf_counter()
    results = run_ranks(_measure, world, (configs, gpt, what, args.steps), timeout_s=1800)
    cal = from_samples([r[0] for r in results], what, shape)
    print(f"measured in {time.perf_counter() - started:.0f} s; calibration: {cal.describe()}\n")
    hw = Hardware(world, 1e12, calibration=cal)
    candidates = {s.label(): evaluate(shape, s, hw, work) for s in SETUPS}
    # per round the slower rank (the barriers make them nearly equal), then the median
    rounds = {name: [max(r[1][name][i] for r in results) for i in range(args.steps)]
              for name in configs}
    slowest = {name: statistics.median(t) for name, t in rounds.items()}
    spread = [max(r["forward_backward"] for r in rank) / min(r["forward_backward"] for r in rank)
              for rank in (r[0] for r in results)]
    print(f"noise: forward+backward max/min over the rounds {max(spread):.2f}; steps "
          + ", ".join(f"{max(t) / min(t):.2f}" for t in rounds.values()))
    print(f"{'setup':<32}{'compute':>9}{'comm':>8}{'optim':>8}{'offload':>9}"
          f"{'predicted':>11}{'measured':>10}{'error':>8}")
    rows = {}
    for name, c in candidates.items():
        t = c.time
        error = t.serial / slowest[name] - 1
        rows[name] = {"predicted": t.serial, "measured": slowest[name], "compute": t.compute,
                      "comm": t.comm, "optimizer": t.optimizer, "offload": t.offload}
        print(f"{name:<32}{t.compute:>9.3f}{t.comm:>8.3f}{t.optimizer:>8.3f}{t.offload:>9.3f}"
              f"{t.serial:>11.3f}{slowest[name]:>10.3f}{error:>+8.0%}")
    names = list(rows)
    agree = disagree = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa, pb = rows[a]["predicted"], rows[b]["predicted"]
            if abs(pa / pb - 1) <= 0.10:
                continue  # predicted equal within 10 %: no direction to check
            same = (pa > pb) == (rows[a]["measured"] > rows[b]["measured"])
            agree, disagree = agree + same, disagree + (not same)
            if not same:
                print(f"  ratio the wrong way: {a} / {b} predicted {pa / pb:.2f}, measured "
                      f"{rows[a]['measured'] / rows[b]['measured']:.2f}")
    print(f"ratios between setups predicted >10 % apart: {agree} point the measured way, "
          f"{disagree} do not")
    if args.out:
        Path(args.out).write_text(json.dumps({"calibration": cal.to_dict(), "setups": rows,
                                              "rounds": rounds}, indent=2) + "\n")


if __name__ == "__main__":
    main()
