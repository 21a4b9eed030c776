"""Predicted against measured step time: `zeromem plan --calibrate` on this machine.

    python benchmarks/bench_plan.py [--nvme-path DIR] [--steps 5] [--out results/plan.json]

1. Calibrate (planning/calibrate.py): the demo GPT's forward and backward, the
   gloo collectives through the engine's Comm, copies, swap I/O and AdamW's step,
   on 2 spawned ranks (the same figures `zeromem plan --calibrate` measures).
2. Predict each setup's step with the planner (`evaluate` with the calibration),
   from the config the planner writes for it (`deepspeed_config`).
3. Measure in interleaved rounds (`--rounds`, after 2 warm-up rounds): each round
   takes one calibration sample (`calibrate.Probe`) and then one barrier-to-barrier
   step of every setup's engine (built from that config on 2 gloo ranks, all alive
   at once), in an order rotated from round to round, each step right after a
   forward and backward of the bare model (`Probe.sample_compute`). Each step is
   predicted from its round's calibration with that adjacent compute sample, so
   that load from other processes on a shared machine (which moves within
   seconds) falls on prediction and step alike.

Prints, per setup, the step predicted from the median calibration of all rounds
against the median measured step, and the median of the per-step errors (each step
against its own round's prediction) with their spread (lowest and highest round);
and, for every pair of setups whose predictions (median calibration: the model's
difference, not the noise's) differ by more than 10 %, the median of the measured
per-round ratios and in how many rounds it points the predicted way.
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
             rounds: int) -> list[tuple[dict, dict[str, float]]]:
    """Per round: one calibration sample, then one step of each engine (order rotated)."""
    import torch.distributed as dist

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
            dist.barrier()
            start = time.perf_counter()
            engine.backward(engine(x, x))
            engine.step()
            dist.barrier()
            times[name] = time.perf_counter() - start
        if i >= 2:
            out.append((sample, times))
    for engine in engines.values():
        engine.close()
    probe.close()
    return out


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """(lowest, median, highest)."""
    return min(values), statistics.median(values), max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
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
    results = run_ranks(_measure, world, (configs, gpt, what, args.rounds), timeout_s=3000)
    cal = from_samples([[s for s, _ in rank] for rank in results], what, shape)
    print(f"measured in {time.perf_counter() - started:.0f} s; calibration (median of the "
          f"rounds): {cal.describe()}\n")
    common = {s.label(): evaluate(shape, s, Hardware(world, 1e12, calibration=cal), work).time
              for s in SETUPS}
    predicted: dict[str, list[float]] = {name: [] for name in configs}
    measured: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for s in SETUPS:
            # this round's calibration with the compute sampled beside this step (each rank's
            # sample, the slower rank), and the step (the slower rank)
            name = s.label()
            cal_r = from_samples([[{**rank[r][0], "forward_backward": rank[r][0][name]}]
                                  for rank in results], what, shape)
            t = evaluate(shape, s, Hardware(world, 1e12, calibration=cal_r), work).time
            predicted[name].append(t.serial)
            measured[name].append(max(rank[r][1][name] for rank in results))
    fb = [max(rank[r][0]["forward_backward"] for rank in results) for r in range(args.rounds)]
    print(f"noise: forward+backward highest/lowest round {max(fb) / min(fb):.2f}; steps "
          + ", ".join(f"{max(t) / min(t):.2f}" for t in measured.values()))
    print(f"{'setup':<32}{'compute':>8}{'comm':>7}{'optim':>7}{'offload':>8}{'overhead':>9}"
          f"{'predicted':>10}{'measured':>9}{'error':>7}   per step: median (lowest, highest)")
    rows = {}
    for name in configs:
        errors = [p / m - 1 for p, m in zip(predicted[name], measured[name])]
        low, mid, high = _quartiles(errors)
        t, mm = common[name], statistics.median(measured[name])
        split = (t.compute, t.comm, t.optimizer, t.offload, t.overhead)
        rows[name] = {"predicted": t.serial, "measured": mm, "error": t.serial / mm - 1,
                      "step_error": mid, "step_error_low": low, "step_error_high": high,
                      "rounds_predicted": predicted[name], "rounds_measured": measured[name],
                      **dict(zip(("compute", "comm", "optimizer", "offload", "overhead"), split))}
        print(f"{name:<32}{split[0]:>8.3f}{split[1]:>7.3f}{split[2]:>7.3f}{split[3]:>8.3f}"
              f"{split[4]:>9.4f}{t.serial:>10.3f}{mm:>9.3f}{t.serial / mm - 1:>+7.0%}   "
              f"{mid:+.0%} ({low:+.0%}, {high:+.0%})")
    _ratios(rows, predicted, measured)
    if args.out:
        Path(args.out).write_text(json.dumps({"calibration": cal.to_dict(), "setups": rows,
                                              "workload": vars(args)}, indent=2) + "\n")


def _ratios(rows: dict, predicted: dict[str, list[float]], measured: dict[str, list[float]]) -> None:
    """For each pair predicted >10 % apart: rounds whose measured ratio points the same way."""
    names = list(rows)
    agree = disagree = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa, pb = rows[a]["predicted"], rows[b]["predicted"]
            if abs(pa / pb - 1) <= 0.10:
                continue  # predicted equal within 10 %: no direction to check
            ratios = [ma / mb for ma, mb in zip(measured[a], measured[b])]
            same = sum((r > 1) == (pa > pb) for r in ratios)
            median = statistics.median(ratios)
            ok = (median > 1) == (pa > pb)
            agree, disagree = agree + ok, disagree + (not ok)
            print(f"  {'ok   ' if ok else 'WRONG'} {a} / {b}: predicted {pa / pb:.2f}, measured "
                  f"{median:.2f} (median), the predicted way in {same} of {len(ratios)} rounds")
    print(f"ratios between setups predicted >10 % apart: {agree} point the measured way "
          f"(median over the rounds), {disagree} do not")


if __name__ == "__main__":
    main()
