"""`zeromem bench`: one model's training step under zeromem beside DDP, FSDP2 and DeepSpeed.

    zeromem bench MODEL --config ds_config.json [--nproc 2] [--systems ddp,fsdp2,zeromem]
                  [--reps 3] [--warmup 2] [--steps 4] [--seq 128] [--json]

MODEL as `zeromem plan` reads it (`package.module:factory`, or a Hugging Face config .json,
which transformers builds), randomly initialised from seed 0 in every system. Every
system trains it from the same weights on the same batches, with the config's batch
(micro-batch, accumulation), optimizer and precision:

    ddp          DistributedDataParallel, the config's optimizer over whole parameters
    fsdp2        fully_shard on each block (the model's repeated layers), then on the root
    zeromem      zeromem.initialize(model, config)
    deepspeed    deepspeed.initialize with the same config, where deepspeed is installed
    zeromem-S, deepspeed-S   the same with zero_optimization.stage S

A 16-bit config runs DDP under torch.autocast in that dtype and FSDP2 with a
MixedPrecisionPolicy (parameters in it, gradients reduced in fp32), fp16 with torch's
GradScaler. How it measures (as benchmarks/bench_models.py): each system is a trial in
freshly spawned ranks (no system inherits another's heap or patched classes); trials go
round-robin `reps` times, the order rotated each time, so that background load is shared.
A step (the accumulation's micro-batches and the optimizer step) is timed between
barriers and takes as long as its slower rank; reported are the median step, its ratio
to DDP's, each rank's peak memory (the device's allocator on a GPU; on the CPU the
process's resident high-water mark above what it held before the model was built), and
the loss of each step's first micro-batch (the mean over ranks). The first step's loss
is the same in every system (same weights, same batch), and in fp32 the last one too
(the config's optimizer, clipping and scheduler in each): a system that differs there
trains something else.
"""
from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from zeromem.config.rules import resolve_batch
from zeromem.planning.activation_trace import example_inputs, find_blocks, training_loss
from zeromem.planning.calibrate import run_ranks
from zeromem.planning.model_shapes import build_real, config_dict, model_dims

BASELINES = ("ddp", "fsdp2")
ENGINES = ("zeromem", "deepspeed")
SYSTEMS = BASELINES + ENGINES + tuple(f"{e}-{stage}" for e in ENGINES for stage in range(4))
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class Bench:
    """What one `zeromem bench` run measures."""

    model: str  # MODEL, as `zeromem plan` takes it
    config: dict  # the DeepSpeed config, as JSON gives it
    nproc: int = 2
    systems: tuple[str, ...] = ("ddp", "fsdp2", "zeromem", "deepspeed")
    reps: int = 3
    warmup: int = 2
    steps: int = 4
    seq: int = 128


@dataclass
class Result:
    """One system's figures over all its trials."""

    seconds: list[float] = field(default_factory=list)  # every timed step
    peak_bytes: int = 0  # the largest rank's, over the trials
    losses: list[float] = field(default_factory=list)  # each step's, in the last trial
    stage: int | None = None  # the ZeRO stage the engine ran (None: DDP, FSDP2)
    error: str | None = None  # why a trial failed (the system then runs no more trials)

    @property
    def step_s(self) -> float:
        return statistics.median(self.seconds)


def check_systems(systems: tuple[str, ...]) -> None:
    """Refuse a system this command does not know, naming it."""
    for system in systems:
        if system not in SYSTEMS:
            raise ValueError(f"unknown system {system!r}: ddp, fsdp2, zeromem, deepspeed, or "
                             "zeromem-S / deepspeed-S for ZeRO stage S (0-3)")


def unavailable(bench: Bench) -> dict[str, str]:
    """Why a system cannot run this bench here, by system: its library is not installed, or
    it cannot train with the config's optimizer."""
    why: dict[str, str] = {}
    if importlib.util.find_spec("deepspeed") is None:
        why |= {s: "deepspeed is not installed" for s in bench.systems if s.startswith("deepspeed")}
    if (bench.config.get("optimizer") or {}).get("type", "").lower() == "muon":
        why |= {s: "Muon steps each matrix whole; FSDP2 shards it and torch has no Muon for "
                   "its shards" for s in bench.systems if s == "fsdp2"}
    return why


def run(bench: Bench, echo: Callable[[str], None] = print) -> dict[str, Result]:
    """Every available system's trials, round-robin; by system, in `bench.systems` order."""
    check_systems(bench.systems)
    if bench.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {bench.steps}")
    resolved_config(bench.config, bench.nproc)  # a batch that cannot resolve fails here, once
    skipped = unavailable(bench)
    systems = [s for s in bench.systems if s not in skipped]
    if not systems:  # all skipped (`table` says why)
        return {}
    results = {s: Result() for s in systems}
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= bench.nproc \
        else "gloo"
    for rep in range(bench.reps):
        shift = rep % len(systems)
        for system in systems[shift:] + systems[:shift]:
            result = results[system]
            if result.error is not None:
                continue
            began = time.perf_counter()
            try:
                ranks = run_ranks(_trial, bench.nproc, (bench, system), backend,
                                  timeout_s=3600)
            except (RuntimeError, TimeoutError) as error:  # a rank's traceback, or none
                result.error = str(error).strip().splitlines()[-1]
                echo(f"rep {rep} {system:<12} failed: {error}")
                continue
            result.seconds += ranks[0]["seconds"]
            result.peak_bytes = max([result.peak_bytes] + [r["peak_bytes"] for r in ranks])
            result.losses, result.stage = ranks[0]["losses"], ranks[0]["stage"]
            echo(f"rep {rep} {system:<12} {time.perf_counter() - began:6.1f} s")
    return results


def table(bench: Bench, results: dict[str, Result]) -> str:
    """One line per system: median step, its ratio to DDP's, peak memory, first and last
    step's loss."""
    ddp = results.get("ddp")
    lines = [f"{'system':<14}{'step ms':>10}{'/ DDP':>8}{'peak MB':>10}{'first loss':>14}"
             f"{'last loss':>14}"]
    for system, r in results.items():
        if r.error is not None:
            lines.append(f"{system:<14}failed: {r.error}")
            continue
        ratio = f"{r.step_s / ddp.step_s:.2f}" if ddp is not None and ddp.seconds else "-"
        lines.append(f"{system:<14}{1e3 * r.step_s:>10.1f}{ratio:>8}"
                     f"{r.peak_bytes / 1e6:>10.1f}{r.losses[0]:>14.6f}{r.losses[-1]:>14.6f}")
    lines += [f"skipped {s}: {why}" for s, why in unavailable(bench).items()]
    return "\n".join(lines)


def as_json(bench: Bench, results: dict[str, Result]) -> dict:
    """Every step's time and loss by system (or its error), and the systems skipped."""
    return {"systems": {s: {"error": r.error} if r.error is not None else
                        {"step_s": r.step_s, "seconds": r.seconds, "peak_bytes": r.peak_bytes,
                         "losses": r.losses, "stage": r.stage} for s, r in results.items()},
            "skipped": unavailable(bench)}


# ---------------------------------------------------------------- one trial, on each rank

def _trial(rank: int, world_size: int, bench: Bench, system: str) -> dict:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    memory = _PeakMemory(device)
    torch.manual_seed(0)
    model = build_real(bench.model).to(device)
    config = resolved_config(bench.config, world_size)
    inputs = _Inputs.of(model, config["train_micro_batch_size_per_gpu"], bench.seq)
    step, stage = _system(system, model, bench.config, device, world_size)
    seconds, losses = [], []
    for i in range(bench.warmup + bench.steps):
        batches = [inputs.batch(1_000_003 * rank + 1009 * i + micro, device)
                   for micro in range(config["gradient_accumulation_steps"])]
        dist.barrier()
        started = time.perf_counter()
        loss = step(batches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = torch.tensor(time.perf_counter() - started, device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step takes as long as its slower rank
        losses.append(_mean_over_ranks(loss, device, world_size))
        if i >= bench.warmup:
            seconds.append(float(took))
    return {"seconds": seconds, "peak_bytes": memory.peak(), "losses": losses, "stage": stage}


def _mean_over_ranks(value: float, device: torch.device, world_size: int) -> float:
    total = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total) / world_size


@dataclass(frozen=True)
class _Inputs:
    """The model's micro-batches: token ids of its vocabulary, `seq` long (or its context,
    where that is shorter), as its forward takes them (`example_inputs`)."""

    model: nn.Module
    micro_batch: int
    seq: int
    vocab: int

    @classmethod
    def of(cls, model: nn.Module, micro_batch: int, seq: int) -> _Inputs:
        dims = model_dims(model, config_dict(getattr(model, "config", None)))
        return cls(model, micro_batch, min(seq, dims.get("positions", seq)), dims.get("vocab", 2))

    def batch(self, seed: int, device: torch.device) -> tuple[tuple, dict]:
        """(args, kwargs) drawn from `seed`: the same in every system."""
        torch.manual_seed(seed)
        args, kwargs = example_inputs(self.model, self.micro_batch, self.seq, self.vocab)
        return tuple(a.to(device) for a in args), {k: v.to(device) for k, v in kwargs.items()}


Step = Callable[[list[tuple[tuple, dict]]], float]


def resolved_config(config: dict, world_size: int, stage: str = "") -> dict:
    """`config` with its batch triple resolved as DeepSpeed resolves it on `world_size` ranks
    ("auto", which Hugging Face's Trainer fills, counts as not given), and the ZeRO stage
    `stage` if given."""
    given = [config.get(key) if config.get(key) != "auto" else None for key in BATCH_KEYS]
    train, micro, gas = resolve_batch(given[0], given[1], given[2], world_size)
    return {**config, **dict(zip(BATCH_KEYS, (train, micro, gas))),
            "zero_optimization": {**config.get("zero_optimization", {}),
                                  **({"stage": int(stage)} if stage else {})}}


def _system(system: str, model: nn.Module, config: dict, device: torch.device,
            world_size: int) -> tuple[Step, int | None]:
    """The step function of `system` over `model`, and the ZeRO stage its engine runs."""
    name, _, stage = system.partition("-")
    config = resolved_config(config, world_size, stage)
    if name in BASELINES:
        return _torch_step(name, model, config, device, world_size), None
    if name == "deepspeed":
        import deepspeed
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)[0]
    elif name == "zeromem":
        import zeromem
        engine = zeromem.initialize(model, config)
    else:
        raise ValueError(f"not an engine: {system!r}")

    def engine_step(batches: list[tuple[tuple, dict]]) -> float:
        first = None
        for args, kwargs in batches:
            loss = training_loss(engine(*args, **kwargs))
            engine.backward(loss)
            engine.step()
            first = float(loss.detach()) if first is None else first
        assert first is not None
        return first
    stage_run = engine.zero_optimization_stage() if name == "deepspeed" else engine.zero_stage
    return engine_step, int(stage_run)


def _torch_step(name: str, model: nn.Module, config: dict, device: torch.device,
                world_size: int) -> Step:
    """DDP or FSDP2 over `model`, with the config's optimizer, clipping and scheduler on
    whole parameters, and its precision as torch users set it."""
    from zeromem.config.schema import Config
    from zeromem.optim.factory import kernel_options, optimizer_param_groups
    from zeromem.optim.schedulers import build_scheduler
    cfg = Config.load(config, world_size=world_size)
    dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else None
    wrapped, sync, autocast = (_ddp if name == "ddp" else _fsdp2)(model, dtype, device)
    if cfg.optimizer is None:
        raise ValueError("the config names no optimizer: DDP and FSDP2 train with the config's")
    cls = cfg.optimizer.torch_class
    # Muon's matrices and the rest in groups of their own, as zeromem and DeepSpeed group them
    groups = optimizer_param_groups(cfg.optimizer, model, None)
    optimizer = cls(groups, **kernel_options(cls, dict(cfg.optimizer.params)))
    scheduler = build_scheduler(cfg.scheduler, optimizer)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    clip = float(cfg.gradient_clipping or 0.0)

    def torch_step(batches: list[tuple[tuple, dict]]) -> float:
        first = None
        for k, (args, kwargs) in enumerate(batches):
            with sync(k == len(batches) - 1), autocast():
                loss = training_loss(wrapped(*args, **kwargs))
            scaled = loss / len(batches)
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            first = float(loss.detach()) if first is None else first
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        assert first is not None
        return first
    return torch_step


Context = Callable[[], contextlib.AbstractContextManager]
Wrapped = tuple[nn.Module, Callable[[bool], contextlib.AbstractContextManager], Context]


def _ddp(model: nn.Module, dtype: torch.dtype | None, device: torch.device) -> Wrapped:
    """(DDP over `model`, its gradient sync switch (`no_sync` but for the last micro-batch),
    torch.autocast in the 16-bit dtype)."""
    ddp = nn.parallel.DistributedDataParallel(model)

    def sync(last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else ddp.no_sync()

    def autocast() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype)
    return ddp, sync, autocast


def _fsdp2(model: nn.Module, dtype: torch.dtype | None, device: torch.device) -> Wrapped:
    """(`model` under fully_shard, per block then the root; its gradient sync switch; no
    autocast: the 16-bit dtype is the MixedPrecisionPolicy's, reductions in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) \
        if dtype is not None else MixedPrecisionPolicy()
    for block in find_blocks(model)[1]:
        fully_shard(block, mp_policy=policy)
    root = fully_shard(model, mp_policy=policy)

    def sync(last: bool) -> contextlib.AbstractContextManager:
        root.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return model, sync, contextlib.nullcontext


class _PeakMemory:
    """A rank's peak memory from now on: the device allocator's on a GPU; on the CPU the
    resident high-water mark above the resident bytes now (Linux: /proc/self)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            return
        self.base = _status_bytes("VmRSS")
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return max(0, _status_bytes("VmHWM") - self.base)


def _status_bytes(key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0
