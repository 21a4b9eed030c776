"""What the engine reports besides training: DeepSpeed's monitors, comms logger, flops
profiler, throughput timer and memory breakdown, as the config's extras ask
(config/extras.py). The engine calls `Observers` at its hooks and knows nothing else;
the observers get what they report passed in (the `Comm`, the step counters, a
`StepFacts` after each step) and never call back into the engine.

Monitors (`csv_monitor`, `tensorboard`, `wandb`) are written by rank 0 at every optimizer
step, with DeepSpeed's event names and x axis (samples seen: global steps x
train_batch_size):

    Train/Samples/train_loss     the step's loss: mean over micro-steps and ranks
    Train/Samples/lr             the first param group's learning rate
    Train/Samples/loss_scale     fp16 only (DeepSpeed writes it for fp16 only too)
    Train/Samples/grad_norm      the global gradient norm before clipping
    Train/Samples/model_state_bytes   this rank's model states (engine.memory_report())
    Train/Samples/max_memory_allocated   CUDA only: torch.cuda.max_memory_allocated()

DeepSpeed's engine writes lr and loss_scale; its pipeline engine writes train_loss. The
loss needs one all-reduce of a scalar per step (ledger kind "monitor").

The CSV monitor writes DeepSpeed's files: output_path/job_name/<name with / as _>.csv,
a header `step,<last part of the name>`, then `step,value` rows.
"""
from __future__ import annotations

import csv
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zeromem.monitoring.comm_log import CommLog
from zeromem.monitoring.flops import FlopsProfiler

if TYPE_CHECKING:
    from zeromem.comm import Comm
    from zeromem.config.schema import Config
    from zeromem.memory import MemoryReport
    from zeromem.training_state import StepCounters

log = logging.getLogger("zeromem")

Event = tuple[str, float, int]  # (name, value, samples)


class CsvMonitor:
    """`csv_monitor`: one CSV file per event name, as DeepSpeed's csvMonitor writes them."""

    def __init__(self, config):
        self.directory = os.path.join(config.output_path, config.job_name)
        os.makedirs(self.directory, exist_ok=True)
        self.started: set[str] = set()

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            file = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.directory, f"{file}.csv"), "a", newline="") as handle:
                writer = csv.writer(handle)
                if file not in self.started:
                    self.started.add(file)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardMonitor:
    """`tensorboard`: scalars in an event file under output_path/job_name."""

    def __init__(self, config):
        from torch.utils.tensorboard import SummaryWriter
        directory = os.path.join(config.output_path, config.job_name)
        os.makedirs(directory, exist_ok=True)
        self.writer = SummaryWriter(log_dir=directory)

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbMonitor:
    """`wandb`: a Weights & Biases run (project, group, team as entity), as DeepSpeed's."""

    def __init__(self, config):
        import wandb
        self.wandb = wandb
        wandb.init(project=config.project, group=config.group, entity=config.team)

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        pass


def build_monitors(config) -> list:
    """The monitors the config enables (call on rank 0 only)."""
    monitors: list = []
    if config.csv_monitor.enabled:
        monitors.append(CsvMonitor(config.csv_monitor))
    if config.tensorboard.enabled:
        monitors.append(TensorBoardMonitor(config.tensorboard))
    if config.wandb.enabled:
        monitors.append(WandbMonitor(config.wandb))
    return monitors


@dataclass(frozen=True)
class StepFacts:
    """What the engine tells its observers after each optimizer step."""

    lr: list[float]  # each param group's learning rate
    loss_scale: float
    grad_norm: float | None  # before clipping; None when not computed
    memory: MemoryReport | None  # the engine's memory report when `wants_memory_report`


class Observers:
    """The engine's reporting: called at forward, backward, and after each optimizer step."""

    def __init__(self, config: Config, comm: Comm, device: torch.device, psi: int,
                 counters: StepCounters):
        """`psi`: the trained parameters; `counters`: the engine's step counters (read only)."""
        self.config = config
        self.comm, self.device, self.counters = comm, device, counters
        if config.log_level is not None:
            logging.getLogger("zeromem").setLevel(config.log_level.upper())
        self.rank = comm.rank
        self.monitoring = config.monitoring
        self.monitors = build_monitors(config) if self.monitoring and self.rank == 0 else []
        self.losses: list[torch.Tensor] = []
        if config.comms_logger.enabled:
            comm.log = CommLog(config.comms_logger, comm.world_size, self.rank)
        self.flops = (FlopsProfiler(config, comm, device, psi, counters)
                      if config.flops_profiler.enabled else None)
        self.throughput = config.timers.throughput
        self._mark = (time.perf_counter(), 0)  # (clock, samples trained) at the last log line
        if config.dump_state and self.rank == 0:
            log.info("zeromem config (dump_state):\n%s", config.describe())

    # -- hooks ---------------------------------------------------------------
    def forward(self):
        """A context around the engine's forward (the flops profiler counts in it)."""
        return self.flops.phase("forward") if self.flops is not None else _nothing()

    def backward(self, loss: torch.Tensor | None):
        """A context around the engine's backward of `loss` (None: a `loss.backward()` of
        the caller's, whose loss the engine never sees)."""
        if self.monitoring and loss is not None:
            self.losses.append(loss.detach().float().reshape(()))
        return self.flops.phase("backward") if self.flops is not None else _nothing()

    def wants_memory_report(self, printing: bool) -> bool:
        """Whether this step's `StepFacts` needs the memory report (built on this rank only):
        for the monitors (rank 0), or for a log line (`printing`) with `memory_breakdown`."""
        return (self.monitoring and self.rank == 0) or (printing and self.config.memory_breakdown)

    def after_step(self, facts: StepFacts) -> None:
        """After an optimizer step (applied or skipped on overflow)."""
        if self.flops is not None:
            self.flops.after_step()
        if self.monitoring:
            self._write_events(facts)

    def _write_events(self, facts: StepFacts) -> None:
        loss = torch.stack(self.losses).mean() if self.losses else torch.zeros(())
        self.losses.clear()
        if self.comm.world_size > 1:  # every rank: the mean over the data-parallel ranks
            loss = loss.to(self.device)
            self.comm.all_reduce(loss, kind="monitor")
            loss = loss / self.comm.world_size
        if self.rank != 0:
            return
        samples = self.counters.global_samples
        events: list[Event] = [("Train/Samples/train_loss", float(loss), samples),
                               ("Train/Samples/lr", float(facts.lr[0]), samples)]
        if self.config.fp16.enabled:
            events.append(("Train/Samples/loss_scale", float(facts.loss_scale), samples))
        if facts.grad_norm is not None:
            events.append(("Train/Samples/grad_norm", float(facts.grad_norm), samples))
        if facts.memory is not None:
            events.append(("Train/Samples/model_state_bytes",
                           float(facts.memory.model_state_bytes()), samples))
        if self.device.type == "cuda":
            events.append(("Train/Samples/max_memory_allocated",
                           float(torch.cuda.max_memory_allocated(self.device)), samples))
        for monitor in self.monitors:
            monitor.write(events)

    def log_line_extras(self, facts: StepFacts) -> str:
        """What the step log line adds: samples per second, the memory report."""
        text = ""
        if self.throughput.enabled:
            if self.throughput.synchronized and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now, samples = time.perf_counter(), self.counters.global_samples
            then, before = self._mark
            self._mark = (now, samples)
            if samples > before and now > then:
                rate = (samples - before) / (now - then)
                text += f", {rate:.1f} samples/s"
        if self.config.memory_breakdown and facts.memory is not None:
            text += f"\n{facts.memory}"
        return text

    def close(self) -> None:
        """At the end of training: the comms summary (rank 0), and the monitors' files."""
        if self.comm.log is not None and self.rank == 0:
            log.info("communication summary (comms_logger):\n%s", self.comm.log.summary())
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []


def due(step: int, every: float) -> bool:
    """Whether `step` is a multiple of `every` (steps_per_print; Infinity: never)."""
    return math.isfinite(every) and step % int(every) == 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
