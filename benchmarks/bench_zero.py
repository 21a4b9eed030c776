"""Compare data-parallel training systems on CPU gloo ranks, interleaved in one run.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/bench_zero.py [--dtype bf16]

Systems: torch DDP + AdamW (the baseline), torch ZeroRedundancyOptimizer(AdamW) + DDP,
DeepSpeed ZeRO stages 0/1/2 (optional dependency), FSDP2 (`fully_shard` per block and
root), and zeromem stages 0/1/2/3. All train `examples/gpt.py`'s GPT from the same seed on the same
micro-batches with AdamW(lr=1e-3, weight_decay=0.01).

How it measures (README.md has the long form):

* Each (repetition, system) is a *trial*: the torchrun ranks are coordinators that start
  one fresh worker process per rank for the trial and wait for it, so no system inherits
  another's heap, globals (DeepSpeed keeps many) or patched modules (FSDP2 swaps module
  classes). Trials run round-robin over systems for `--reps` repetitions, rotating the
  order each repetition, so machine noise is shared.
* Step time: forward + backward + optimizer step, after `--warmup` steps; ranks meet at
  a barrier before each step (outside the timed region); a step's time is the slower
  rank's. Reported: median over all timed steps of all repetitions, the range of the
  per-repetition medians, and the ratio to DDP's median.
* Peak RSS: the worker resets the kernel's high-water mark (/proc/self/clear_refs "5")
  after its imports and process-group set-up, then reads VmHWM from /proc/self/status at
  the end. `ru_maxrss` is not used: it is monotonic over the process and, for an exec'd
  child, starts at the parent's peak. Reported per rank (the larger rank): the growth over
  the post-import RSS, and the absolute peak.
* Model-state bytes: after one extra backward (before its optimizer step) the worker
  counts distinct tensor storages: model parameters, their .grad, every optimizer state
  tensor reachable from the system's optimizer object, master copies (params of an inner
  optimizer that are not model params) and any other tensor reachable from the optimizer
  or engine object (buckets, gradient partitions). DDP runs with
  gradient_as_bucket_view=True so its reducer buckets are the grads and get counted.
  zeromem's own `memory_report()` total is shown beside it.
* Bytes sent: `wchar` from /proc/self/io (bytes the process wrote through write/writev,
  which gloo's TCP transport uses for every send) summed over the timed steps, per step,
  larger rank. This is what went on the wire, whatever the library meant to send.
  zeromem's `comm_report()["last_step"]` total (what it says it moved) is shown beside it.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from measure import (bytes_written, count_model_state, peak_rss_bytes, reset_peak_rss,  # noqa: E402
                     rss_bytes, sum_nested)

HERE = Path(__file__).resolve().parent
REPO_SRC = HERE.parent / "src"
DEFAULT_OUT = HERE / "results" / "bench_zero.json"

TORCH_SYSTEMS = ["ddp", "ddp+zero_optimizer", "fsdp2"]
DEEPSPEED_SYSTEMS = ["deepspeed-0", "deepspeed-1", "deepspeed-2", "deepspeed-3"]
ZEROMEM_SYSTEMS = ["zeromem-0", "zeromem-1", "zeromem-2", "zeromem-3"]
ALL_SYSTEMS = ["ddp", "ddp+zero_optimizer", *DEEPSPEED_SYSTEMS, "fsdp2", *ZEROMEM_SYSTEMS]

LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01
SEED = 0


# ----------------------------------------------------------------------------- options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="round-robin repetitions")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per trial")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per trial")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--bucket-numel", type=int, default=2 ** 21,
                        help="reduce/all-gather bucket size in elements (DDP gets the same in MB)")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                        help="comma-separated subset of: " + ", ".join(ALL_SYSTEMS))
    parser.add_argument("--trial-timeout", type=float, default=300.0, help="seconds per trial")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # JSON spec: run one trial
    return parser.parse_args(argv)


def import_zeromem() -> Any:
    """zeromem, from the environment or else from this checkout's src/."""
    try:
        return importlib.import_module("zeromem")
    except ImportError:
        sys.path.append(str(REPO_SRC))
        return importlib.import_module("zeromem")


# ----------------------------------------------------------------------------- /proc probes


@dataclass
class Runner:
    """One system under test: a loss function, a backward, a step, and what to census."""

    forward: Callable[[Any, Any], Any]
    backward: Callable[[Any], None]
    step: Callable[[], None]
    model: Any  # whose .parameters() are the model params (sharded ones for FSDP2)
    census_root: Any  # optimizer or engine object the census walks
    self_report: Callable[[], dict[str, Any]] | None = None  # zeromem's own reports
    notes: list[str] = field(default_factory=list)


def _autocast(dtype: str) -> Any:
    import contextlib
    import torch
    if dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _torch_runner(model: Any, optimizer: Any, wrapped: Any, dtype: str) -> Runner:
    def forward(tokens: Any, targets: Any) -> Any:
        with _autocast(dtype):
            return wrapped(tokens, targets)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Runner(forward, lambda loss: loss.backward(), step, model, optimizer)


def build_ddp(model: Any, args: argparse.Namespace, zero_optimizer: bool) -> Runner:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    # gradient_as_bucket_view: grads live in the reducer's buckets, so the census sees them.
    wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_numel * 4 / 2 ** 20,
                                      gradient_as_bucket_view=True)
    if zero_optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                            lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE,
                                      weight_decay=WEIGHT_DECAY)
    runner = _torch_runner(model, optimizer, wrapped, args.dtype)
    if args.dtype == "bf16":
        runner.notes.append("bf16 = torch.autocast; params, grads and reduction stay fp32")
    return runner


def build_fsdp2(model: Any, args: argparse.Namespace) -> Runner:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if args.dtype == "bf16":  # bf16 compute and reduction, fp32 sharded params
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    return _torch_runner(model, optimizer, model, "fp32")


def deepspeed_config(stage: int, args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed's config for one stage; zeromem takes the same dict minus the torch_adam key."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10 ** 9,
        # DeepSpeed 0.19 defaults gradient_clipping to 1.0 (its config.py); the torch
        # baselines do not clip, and clipping changes AdamW's update wherever |grad| ~ eps.
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": LEARNING_RATE, "weight_decay": WEIGHT_DECAY,
                                 # torch.optim.AdamW rather than DeepSpeed's compiled Adam ops
                                 "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket_numel,
                              "allgather_bucket_size": args.bucket_numel},
        "bf16": {"enabled": args.dtype == "bf16"},
    }


def build_deepspeed(model: Any, args: argparse.Namespace, stage: int) -> Runner:
    import deepspeed
    from deepspeed.utils import logger as deepspeed_logger

    deepspeed_logger.setLevel(logging.WARNING)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(stage, args))
    runner = Runner(engine, engine.backward, engine.step, engine.module, optimizer)
    runner.notes.append(f"optimizer class {type(optimizer).__name__}")
    return runner


def build_zeromem(model: Any, args: argparse.Namespace, stage: int) -> Runner:
    zeromem = import_zeromem()
    config = deepspeed_config(stage, args)
    config["optimizer"]["params"].pop("torch_adam")
    from gpt import Block
    engine = zeromem.initialize(model, config, fetch_units=(Block,))  # stage 3: one block a unit

    def self_report() -> dict[str, Any]:
        return {"memory": engine.memory_report().to_dict(), "comm": engine.comm_report().to_dict()}

    return Runner(engine, engine.backward, engine.step, model, engine, self_report)


def build_runner(system: str, model: Any, args: argparse.Namespace) -> Runner:
    if system in ("ddp", "ddp+zero_optimizer"):
        return build_ddp(model, args, zero_optimizer=system != "ddp")
    if system == "fsdp2":
        return build_fsdp2(model, args)
    family, stage = system.rsplit("-", 1)
    if family == "deepspeed":
        return build_deepspeed(model, args, int(stage))
    return build_zeromem(model, args, int(stage))


def import_system_libraries(system: str) -> None:
    """Import what a system needs before the RSS baseline, so library code is not counted."""
    if system.startswith("deepspeed"):
        import deepspeed  # noqa: F401
    elif system.startswith("zeromem"):
        import_zeromem()
    elif system == "fsdp2":
        import torch.distributed.fsdp  # noqa: F401


# ----------------------------------------------------------------------------- worker


def make_batches(count: int, args: argparse.Namespace, rank: int) -> list[tuple[Any, Any]]:
    """Deterministic random byte sequences: batch i of rank r is the same for every system."""
    import torch

    batches = []
    for index in range(count):
        generator = torch.Generator().manual_seed(1_000_003 * index + rank)
        window = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=generator)
        batches.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))  # (B, T) each
    return batches


def timed_steps(runner: Runner, batches: list, args: argparse.Namespace) -> dict[str, Any]:
    """Run warm-up and timed steps; per timed step: seconds, bytes written, zeromem's count."""
    import torch.distributed as dist

    losses, seconds, sent, reported = [], [], [], []
    for index, (tokens, targets) in enumerate(batches):
        dist.barrier()
        written_before, started = bytes_written(), time.perf_counter()
        loss = runner.forward(tokens, targets)
        runner.backward(loss)
        runner.step()
        elapsed, written = time.perf_counter() - started, bytes_written() - written_before
        losses.append(float(loss))
        if index >= args.warmup:
            seconds.append(elapsed)
            sent.append(written)
            if runner.self_report is not None:
                reported.append(sum_nested(runner.self_report()["comm"].get("last_step", {})))
    return {"losses": losses, "step_seconds": seconds, "sent_bytes": sent,
            "self_reported_comm_bytes": reported}


def census_step(runner: Runner, batch: tuple) -> dict[str, Any]:
    """One more step, counting tensors between backward and optimizer step."""
    loss = runner.forward(*batch)
    runner.backward(loss)
    gc.collect()
    census = {"counted": count_model_state(runner.model, runner.census_root)}
    if runner.self_report is not None:
        report = runner.self_report()
        census["self_reported"] = report["memory"]
        census["self_reported_total"] = sum_nested(report["memory"].get("held", {}))
    runner.step()
    census["loss"] = float(loss)
    return census


def run_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """Body of one worker process: build one system, time it, measure it."""
    import torch
    import torch.distributed as dist

    args = argparse.Namespace(**spec["args"])
    # CLOCK_MONOTONIC is system-wide, so the coordinator's launch time is comparable.
    phases = {"launch_and_import_torch": time.monotonic() - spec["launched_at"]}
    started = time.perf_counter()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["pg_timeout"]))
    rank = dist.get_rank()
    import_system_libraries(spec["system"])
    sys.path.insert(0, str(HERE.parent / "examples"))
    from gpt import GPT, count_parameters  # the demo's model

    phases["init_and_imports"] = time.perf_counter() - started
    batches = make_batches(args.warmup + args.steps + 1, args, rank)
    gc.collect()
    hwm_reset = reset_peak_rss()
    baseline = rss_bytes()
    torch.manual_seed(SEED)
    model = GPT()
    numel = count_parameters(model)
    started = time.perf_counter()
    runner = build_runner(spec["system"], model, args)
    phases["build"] = time.perf_counter() - started
    started = time.perf_counter()
    result = timed_steps(runner, batches[:-1], args)
    phases["steps"] = time.perf_counter() - started
    result["census"] = census_step(runner, batches[-1])
    result.update(status="ok", param_numel=numel, rss_baseline_bytes=baseline,
                  rss_peak_bytes=peak_rss_bytes(), hwm_reset=hwm_reset, notes=runner.notes,
                  phase_seconds=phases, load_average_1min=os.getloadavg()[0])
    dist.barrier()
    return result


def worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    try:
        result = run_trial(spec)
    except Exception as error:  # reported through the result file, not a crash
        import traceback
        result = {"status": "failed", "error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()}
    Path(spec["result_path"]).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: some libraries' background threads abort at exit
    # ("terminate called without an active exception"), which says nothing about the trial.
    os._exit(0)


# ----------------------------------------------------------------------------- coordinator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_worker(system: str, port: int, args: argparse.Namespace, scratch: Path,
                  tag: str) -> dict[str, Any]:
    """Run one trial's worker for this rank; return its result (or why there is none)."""
    import torch.distributed as dist

    result_path = scratch / f"{tag}.json"
    log_path = scratch / f"{tag}.log"
    worker_args = {k: v for k, v in vars(args).items() if k not in ("worker", "out")}
    spec = {"system": system, "args": worker_args, "result_path": str(result_path),
            "pg_timeout": min(args.trial_timeout, 120.0)}
    # Without torchrun's agent-store variables the worker's rank 0 hosts its own TCPStore.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
               MASTER_PORT=str(port), RANK=str(dist.get_rank()),
               WORLD_SIZE=str(dist.get_world_size()), DS_ACCELERATOR="cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    spec["launched_at"] = time.monotonic()
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    with open(log_path, "w") as log:
        try:
            subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                           timeout=args.trial_timeout + 30)
        except subprocess.TimeoutExpired:
            pass
    if result_path.exists():
        return json.loads(result_path.read_text())
    tail = log_path.read_text()[-1500:]
    return {"status": "failed", "error": f"worker left no result; log tail:\n{tail}"}


def check_availability(systems: list[str]) -> dict[str, str]:
    """Why a system cannot run here (missing optional package), by system name."""
    unavailable = {}
    if importlib.util.find_spec("deepspeed") is None:
        for name in DEEPSPEED_SYSTEMS:
            unavailable[name] = "unavailable: deepspeed is not installed (pip install deepspeed)"
    try:
        zeromem = import_zeromem()
        has_engine = callable(getattr(zeromem, "initialize", None))
        reason = "unavailable: zeromem.initialize does not exist yet"
    except Exception as error:
        has_engine, reason = False, f"unavailable: import zeromem failed ({error})"
    if not has_engine:
        for name in ZEROMEM_SYSTEMS:
            unavailable[name] = reason
    return {name: why for name, why in unavailable.items() if name in systems}


def prebuild_deepspeed_ops(log: Callable[[str], None]) -> None:
    """Load DeepSpeed's CPU shared-memory comm op once, so its first JIT build is not in a trial.

    DeepSpeed's CPU accelerator builds it at every deepspeed.comm start-up; it serves only
    inference all-reduce, training collectives go through torch.distributed (gloo).
    """
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, DS_ACCELERATOR="cpu"),
                          capture_output=True, text=True, timeout=600)
    status = "ok" if done.returncode == 0 else f"failed ({done.stderr.strip()[-300:]})"
    log(f"DeepSpeed shm comm op load/JIT build: {status}, {time.perf_counter() - started:.1f}s")


def run_rounds(systems: list[str], args: argparse.Namespace, log: Callable[[str], None]
               ) -> dict[str, list[list[dict[str, Any]]]]:
    """Round-robin trials; returns, per system, one [rank0, rank1, ...] result list per rep."""
    import torch.distributed as dist

    trials: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in systems}
    given_up: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="bench_zero_") as scratch:
        for rep in range(args.reps):
            shift = rep % len(systems)
            for system in systems[shift:] + systems[:shift]:
                if system in given_up:
                    continue
                port = [free_port() if dist.get_rank() == 0 else 0]
                dist.broadcast_object_list(port, src=0)
                started = time.perf_counter()
                mine = launch_worker(system, port[0], args, Path(scratch),
                                     f"rep{rep}-{system}-rank{dist.get_rank()}")
                results: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(results, mine)
                trials[system].append(results)
                status = next((r["status"] for r in results if r["status"] != "ok"), "ok")
                log(f"rep {rep} {system:<20} {status:<14} {time.perf_counter() - started:5.1f}s")
                if status != "ok":
                    given_up.add(system)
    return trials


# ----------------------------------------------------------------------------- summary


def summarize(system: str, reps: list[list[dict[str, Any]]], baseline: dict[str, Any] | None
              ) -> dict[str, Any]:
    """One row: medians over repetitions, larger rank where ranks differ."""
    failed = [r for rep in reps for r in rep if r["status"] != "ok"]
    if failed:
        return {"system": system, "status": failed[0]["status"], "error": failed[0].get("error", "")}
    # step time of a step = the slower rank's
    per_rep_steps = [[max(times) for times in zip(*(r["step_seconds"] for r in rep))] for rep in reps]
    all_steps = [t for steps in per_rep_steps for t in steps]
    sent = [max(statistics.mean(r["sent_bytes"]) for r in rep) for rep in reps]
    first = reps[0]
    row = {
        "system": system, "status": "ok",
        "step_ms_median": 1e3 * statistics.median(all_steps),
        "step_ms_rep_medians": [1e3 * statistics.median(s) for s in per_rep_steps],
        "peak_rss_growth_bytes": statistics.median(
            max(r["rss_peak_bytes"] - r["rss_baseline_bytes"] for r in rep) for rep in reps),
        "peak_rss_bytes": statistics.median(max(r["rss_peak_bytes"] for r in rep) for rep in reps),
        "model_state_bytes": max(r["census"]["counted"]["total"] for r in first),
        "model_state_breakdown_rank0": first[0]["census"]["counted"],
        "sent_bytes_per_step": statistics.median(sent),
        "fp32_model_bytes": 4 * first[0]["param_numel"],
        "losses_rank0": first[0]["losses"] + [first[0]["census"]["loss"]],
        "notes": first[0]["notes"],
        "load_average_1min": [r.get("load_average_1min", 0.0) for rep in reps for r in rep[:1]],
    }
    if "self_reported_total" in first[0]["census"]:
        row["self_reported_state_bytes"] = max(r["census"]["self_reported_total"] for r in first)
        row["self_reported_memory_rank0"] = first[0]["census"]["self_reported"]
        row["self_reported_comm_bytes_per_step"] = statistics.median(
            max(statistics.mean(r["self_reported_comm_bytes"] or [0]) for r in rep) for rep in reps)
    if baseline is not None and baseline["status"] == "ok":
        ratios = [mine / theirs for mine, theirs in
                  zip(row["step_ms_rep_medians"], baseline["step_ms_rep_medians"])]
        row["ratio_to_ddp"] = row["step_ms_median"] / baseline["step_ms_median"]
        row["ratio_to_ddp_paired"] = statistics.median(ratios)
        row["max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in
                                          zip(row["losses_rank0"], baseline["losses_rank0"]))
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    mb = 2 ** 20
    header = ("system", "step ms", "rep range", "xDDP", "RSS grow MB", "RSS peak MB", "state MB",
              "self-rep MB", "sent MB/step", "sent/model", "self-rep sent MB", "|dloss| vs DDP")
    lines = [header]
    for row in rows:
        if row["status"] != "ok":
            lines.append((row["system"], row["status"]) + ("",) * (len(header) - 2))
            continue
        lines.append((
            row["system"], f"{row['step_ms_median']:.0f}",
            f"{min(row['step_ms_rep_medians']):.0f}-{max(row['step_ms_rep_medians']):.0f}",
            f"{row['ratio_to_ddp']:.2f}" if "ratio_to_ddp" in row else "-",
            f"{row['peak_rss_growth_bytes'] / mb:.0f}", f"{row['peak_rss_bytes'] / mb:.0f}",
            f"{row['model_state_bytes'] / mb:.1f}",
            f"{row['self_reported_state_bytes'] / mb:.1f}" if "self_reported_state_bytes" in row else "-",
            f"{row['sent_bytes_per_step'] / mb:.1f}",
            f"{row['sent_bytes_per_step'] / row['fp32_model_bytes']:.2f}",
            f"{row['self_reported_comm_bytes_per_step'] / mb:.1f}"
            if "self_reported_comm_bytes_per_step" in row else "-",
            f"{row['max_loss_diff_vs_ddp']:.1e}" if "max_loss_diff_vs_ddp" in row else "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                      enumerate(zip(line, widths))).rstrip() for line in lines]
    text.insert(1, "-" * len(text[0]))
    return "\n".join(text)


LEGEND = """\
step ms       median forward+backward+step over all timed steps (slower rank per step)
rep range     lowest-highest of the per-repetition medians (how much the machine's load moved)
xDDP          step ms / DDP's step ms (the JSON also has the median of per-repetition ratios)
RSS grow MB   per-rank peak RSS (VmHWM, reset after imports) minus RSS after imports; larger rank
RSS peak MB   per-rank absolute peak RSS of the fresh worker process (includes library code)
state MB      counted distinct tensor storages after backward, before step: params, grads,
              optimizer state, master copies, other buffers reachable from the optimizer/engine
self-rep MB   zeromem's memory_report() total ("held", all categories and places)
sent MB/step  bytes written to sockets per rank per step (/proc/self/io wchar, gloo TCP)
sent/model    sent bytes / fp32 model bytes (2-rank ideal: DDP 1.0, ZeRO-1/2 1.0, ZeRO-3 1.5)
self-rep sent zeromem's comm_report()["last_step"] total (what it says it moved), per rank
|dloss|       largest |loss - DDP loss| over all steps on rank 0 (same seed, same batches)"""


def coordinator_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    requested = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(requested) - set(ALL_SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {ALL_SYSTEMS}")
    unavailable = check_availability(requested)
    runnable = [s for s in requested if s not in unavailable]
    for name, why in unavailable.items():
        log(f"{name}: {why}")
    if any(s.startswith("deepspeed") for s in runnable) and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        prebuild_deepspeed_ops(log)
    dist.barrier()
    log(f"{len(runnable)} systems x {args.reps} reps, {args.warmup} warm-up + {args.steps} timed "
        f"steps, micro-batch {args.micro_batch} x {args.seq_len}, {args.dtype}, "
        f"{dist.get_world_size()} ranks, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}")
    started = time.perf_counter()
    trials = run_rounds(runnable, args, log)
    if rank == 0:
        report(requested, unavailable, trials, args, time.perf_counter() - started)
    dist.barrier()
    dist.destroy_process_group()


def report(requested: list[str], unavailable: dict[str, str], trials: dict[str, Any],
           args: argparse.Namespace, seconds: float) -> None:
    baseline = summarize("ddp", trials["ddp"], None) if trials.get("ddp") else None
    rows = []
    for system in requested:
        if system in unavailable:
            rows.append({"system": system, "status": unavailable[system].split(":")[0],
                         "error": unavailable[system]})
        else:
            rows.append(summarize(system, trials[system], baseline))
    print()
    print(format_table(rows))
    print()
    print(LEGEND)
    print()
    for row in rows:
        if row["status"] != "ok":
            print(f"{row['system']}: {row['error'].strip()}")
        elif row["notes"]:
            print(f"{row['system']}: {'; '.join(row['notes'])}")
    ok_rows = [row for row in rows if row["status"] == "ok"]
    if ok_rows:
        loads = [load for row in ok_rows for load in row["load_average_1min"]]
        print(f"parameters: {ok_rows[0]['fp32_model_bytes'] // 4:,} "
              f"({ok_rows[0]['fp32_model_bytes'] / 2 ** 20:.1f} MB fp32); wall time {seconds:.0f}s; "
              f"1-min load average at trial ends: median {statistics.median(loads):.1f}, "
              f"max {max(loads):.1f} on {os.cpu_count()} CPUs")
        if statistics.median(loads) > os.cpu_count():
            print("warning: other processes were competing for the CPUs; absolute times are "
                  "inflated, the interleaved ratios less so")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"args": {k: str(v) for k, v in vars(args).items() if k != "worker"},
               "rows": rows, "trials": trials, "wall_seconds": seconds, "legend": LEGEND}
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"JSON: {args.out}")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args.worker)
    else:
        coordinator_main(args)


if __name__ == "__main__":
    main()
