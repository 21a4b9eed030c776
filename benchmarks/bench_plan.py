"""Predicted against measured step time: `zeromem plan --calibrate` on this machine.

    python benchmarks/bench_plan.py [--nvme-path DIR] [--rounds 10] [--out results/plan.json]
                                    [--raw samples.json] [--from-raw samples.json]

1. Calibrate (planning/calibrate.py): the demo GPT's forward and backward, the
   gloo collectives through the engine's Comm, copies, swap I/O and AdamW's step,
   on 2 spawned ranks (the same figures `zeromem plan --calibrate` measures).
2. Predict each setup's step with the planner (`evaluate` with the calibration),
   from the config the planner writes for it (`deepspeed_config`).
3. Measure in interleaved rounds (`--rounds`, after 2 warm-up rounds): each round
   takes one calibration sample (`calibrate.Probe`) and then one step of every
   setup's engine (built from that config on 2 gloo ranks, all alive at once), in
   an order rotated from round to round, each step right after a forward and
   backward of the bare model (a compute sample, pooled with the calibration's).

Load from other processes. This machine's 2 cores are shared with other jobs, and
the same step's wall time moves 1.5-15x between rounds. Every timing, calibration
and step alike, is taken by `calibrate.Clock`: wall time less the run-queue delay
of the timed thread (the largest over the ranks where the call synchronises them),
which is the time another process held the core. What is left of the load (shared
caches, gloo's and the swap I/O's worker threads) falls alike on calibration and
steps, which are interleaved; medians take out the rest. The run-queue delay is
reported (share of the steps' wall time) as the load the run saw.

Prints, per setup, the step predicted from the calibration (per rank the median over
all samples, then the slower rank) against the median measured step (per round the
slower rank) with a 95 % confidence interval of that median (order statistics),
and the error. Then the ratios between setups: a pair is judged only where the
predicted ratio differs from 1 by more than the measurement resolves, half the
width of the 95 % confidence interval of the measured ratio (the median over the
rounds of the two steps' ratio in the same round); for those it says whether the
measured ratio lies on the predicted side of 1. Pairs the measurement cannot
resolve are counted apart, not judged.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
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
             rounds: int) -> list[tuple[dict, dict[str, tuple[float, float]]]]:
    """Per round: one calibration sample, then one step of each engine (order rotated)."""
    import zeromem
    probe = Probe(what, rank)
    engines = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        engines[name] = zeromem.initialize(GPT(gpt), config)
    x = torch.randint(0, gpt.vocab_size, (what.micro_batch, what.seq))
    names = list(engines)
    out = []
    for i in range(rounds + 2):  # two warm-up rounds
        sample = probe.sample()
        times = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            engine = engines[name]
            sample[name] = probe.sample_compute()["forward_backward"]  # beside this step

            def step(engine=engine) -> None:
                engine.backward(engine(x, x))
                engine.step()
            times[name] = probe.clock.timed(step)  # (wall, delay), as the calibration times
        if i >= 2:
            out.append((sample, times))
    for engine in engines.values():
        engine.close()
    probe.close()
    return out


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95 % confidence interval of the median of `values`: the
    order statistics k and n + 1 - k, k the largest with P(Binomial(n, 1/2) < k) <= 2.5 %
    (n < 6: no such k, the whole range)."""
    ordered, n = sorted(values), len(values)
    k, below = 0, 0.0
    while True:
        below_next = below + math.comb(n, k) / 2 ** n  # P(X <= k)
        if below_next > 0.025:
            break
        k, below = k + 1, below_next
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--raw", help="write every rank's samples and steps as JSON here")
    parser.add_argument("--from-raw", help="analyse samples written by --raw (no measuring)")
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
    if args.from_raw:
        results = json.loads(Path(args.from_raw).read_text())["ranks"]
    else:
        started = time.perf_counter()
        results = run_ranks(_measure, world, (configs, gpt, what, args.rounds), timeout_s=3000)
        print(f"measured in {time.perf_counter() - started:.0f} s")
        if args.raw:
            Path(args.raw).write_text(json.dumps({"ranks": results, "workload": vars(args)}))
    analyse(results, what, shape, work, world, args.out)


def _pooled(rank: list, names: list[str]) -> list[dict]:
    """A rank's calibration samples, with each compute sample taken beside a step as one
    more sample of the forward and backward."""
    return [{**sample, "forward_backward": seconds} for sample, _ in rank
            for seconds in [sample["forward_backward"], *(sample[n] for n in names)]]


def analyse(results: list, what: Measurement, shape, work: Workload, world: int,
            out: str | None) -> dict:
    names = [s.label() for s in SETUPS]
    rounds = len(results[0])
    cal = from_samples([_pooled(rank, names) for rank in results], what, shape)
    print(f"calibration (per rank the median over {rounds} rounds): {cal.describe()}\n")
    hw = Hardware(world, 1e12, calibration=cal)
    # per round, the slower rank (its times are already net of the run-queue delay)
    measured = {n: [max(rank[r][1][n][0] - rank[r][1][n][1] for rank in results)
                    for r in range(rounds)] for n in names}
    wall = [max(rank[r][1][n][0] for rank in results) for n in names for r in range(rounds)]
    delay = [max(rank[r][1][n][1] for rank in results) for n in names for r in range(rounds)]
    print(f"load: run-queue delay {sum(delay) / sum(wall):.0%} of the steps' wall time; "
          f"wall time of the same step highest/lowest round up to "
          + f"{max(max(w) / min(w) for w in _by_setup(results, names, 0)):.1f}x, less the "
          + f"delay up to {max(max(m) / min(m) for m in measured.values()):.2f}x")
    print(f"{'setup':<32}{'compute':>8}{'comm':>7}{'optim':>7}{'offload':>8}{'overhead':>9}"
          f"{'predicted':>10}{'measured':>9}  {'95 % interval':<14}{'error':>6}")
    rows = {}
    for s in SETUPS:
        name, t = s.label(), evaluate(shape, s, hw, work).time
        mm, (low, high) = statistics.median(measured[name]), median_interval(measured[name])
        split = dict(compute=t.compute, comm=t.comm, optimizer=t.optimizer, offload=t.offload,
                     overhead=t.overhead)
        rows[name] = {"predicted": t.serial, "measured": mm, "measured_low": low,
                      "measured_high": high, "error": t.serial / mm - 1,
                      "rounds_measured": measured[name], **split}
        print(f"{name:<32}" + "".join(f"{v:>{w}.3f}" for v, w in zip(split.values(),
                                                                    (8, 7, 7, 8, 9)))
              + f"{t.serial:>10.3f}{mm:>9.3f}  {low:.3f}-{high:.3f}   {t.serial / mm - 1:>+5.0%}")
    ratios = _ratios(rows, measured)
    figures = {"calibration": cal.to_dict(), "setups": rows, "ratios": ratios,
               "load_delay_share": sum(delay) / sum(wall)}
    if out:
        Path(out).write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def _by_setup(results: list, names: list[str], index: int) -> list[list[float]]:
    """Per setup, per round, the slower rank's (wall, delay)[index]."""
    return [[max(rank[r][1][n][index] for rank in results) for r in range(len(results[0]))]
            for n in names]


def _ratios(rows: dict, measured: dict[str, list[float]]) -> dict:
    """Each pair's predicted ratio against the median of its per-round measured ratios,
    judged where the prediction differs from 1 by more than the measurement resolves."""
    names, judged, right, unresolved = list(rows), 0, 0, 0
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            predicted = rows[a]["predicted"] / rows[b]["predicted"]
            per_round = [ma / mb for ma, mb in zip(measured[a], measured[b])]
            ratio, (low, high) = statistics.median(per_round), median_interval(per_round)
            resolution = (high - low) / 2
            pair = {"a": a, "b": b, "predicted": predicted, "measured": ratio,
                    "measured_low": low, "measured_high": high, "resolution": resolution}
            if abs(predicted - 1) <= resolution:
                unresolved += 1
                pairs.append({**pair, "judged": False})
                continue
            ok = (ratio > 1) == (predicted > 1)
            judged, right = judged + 1, right + ok
            pairs.append({**pair, "judged": True, "right": ok})
            print(f"  {'ok   ' if ok else 'WRONG'} {a} / {b}: predicted {predicted:.2f}, "
                  f"measured {ratio:.2f} (95 % {low:.2f}-{high:.2f})")
    print(f"ratios between setups: {judged} of {len(pairs)} pairs predicted further from 1 "
          f"than the measurement resolves; {right} of them point the measured way "
          f"({unresolved} pairs within the measurement's resolution, not judged)")
    return {"pairs": pairs, "judged": judged, "right": right, "unresolved": unresolved}


if __name__ == "__main__":
    main()
