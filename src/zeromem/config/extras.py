"""The DeepSpeed feature blocks zeromem implements besides ZeRO itself.

`Extras` is the base of `Config`: its fields are top-level keys of the DeepSpeed config
with DeepSpeed's names and defaults.

- monitors (`csv_monitor`, `tensorboard`, `wandb`): rank 0 writes loss, learning rate,
  loss scale, gradient norm and memory every optimizer step (zeromem/monitors.py);
  tensorboard and wandb need their package, and a config that enables one that is not
  installed is refused at load;
- `comms_logger`: every collective's size and latency, summarised per kind
  (zeromem/comm.py's ledger; `zeromem.deepspeed.comm.log_summary()`);
- `flops_profiler`: a summary of the model's flops and time at `profile_step`
  (zeromem/flops.py);
- `timers.throughput`: samples per second in the step log line;
- `dump_state`, `memory_breakdown`, `dataloader_drop_last`, `log_level`.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from zeromem.config.rules import Unsupported
from zeromem.config.types import Bool, Float, Int, _Block


def _needs_package(key: str, feature: str, package: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise Unsupported(key, feature, f"the {package!r} package is not installed "
                          f"(pip install {package}); csv_monitor needs nothing", True)


class CSVMonitorConfig(_Block):
    """`csv_monitor`: one CSV file per metric under output_path/job_name (rank 0)."""

    enabled: Bool = False
    output_path: str = ""  # "" = the working directory
    job_name: str = "DeepSpeedJobName"  # directory under output_path


class TensorBoardConfig(_Block):
    """`tensorboard`: a TensorBoard event file under output_path/job_name (rank 0)."""

    enabled: Bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"

    @model_validator(mode="after")
    def _installed(self) -> TensorBoardConfig:
        if self.enabled:
            _needs_package("tensorboard.enabled", "TensorBoard monitor", "tensorboard")
        return self


class WandbConfig(_Block):
    """`wandb`: a Weights & Biases run (rank 0)."""

    enabled: Bool = False
    group: str | None = None  # wandb run group
    team: str | None = None  # wandb entity
    project: str = "deepspeed"

    @model_validator(mode="after")
    def _installed(self) -> WandbConfig:
        if self.enabled:
            _needs_package("wandb.enabled", "Weights & Biases monitor", "wandb")
        return self


class CommsLoggerConfig(_Block):
    """`comms_logger`: record every collective (kind, bytes, latency) for a summary."""

    enabled: Bool = False
    prof_all: Bool = True  # record every kind; False: only those in prof_ops
    prof_ops: list[str] = Field(default_factory=list)  # DeepSpeed op names ("all_reduce", ...)
    verbose: Bool = False  # also log each collective as it completes
    debug: Bool = False  # name the calling function in each record


class FlopsProfilerConfig(_Block):
    """`flops_profiler`: count the flops of one training step and log a summary."""

    enabled: Bool = False
    recompute_fwd_factor: Float = Field(0.0, ge=0)  # forwards recomputed (activation checkpoints)
    profile_step: Int = Field(1, ge=1)  # the optimizer step profiled
    module_depth: Int = Field(-1, ge=-1)  # deepest module level listed; -1 = all
    top_modules: Int = Field(1, ge=0)  # modules listed per level, by flops
    detailed: Bool = True  # list the modules, not only the totals
    output_file: str | None = None  # None = the "zeromem" logger


class ThroughputTimerConfig(_Block):
    """`timers.throughput`: samples per second in the step log line."""

    enabled: Bool = True
    synchronized: Bool = True  # synchronize the device before reading the clock


class TimersConfig(_Block):
    """`timers`."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


class Extras(_Block):
    """Top-level DeepSpeed keys of the features above (the base of `Config`)."""

    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    timers: TimersConfig = Field(default_factory=TimersConfig)
    dump_state: Bool = False  # log every resolved config value at initialize (rank 0)
    memory_breakdown: Bool = False  # log the memory report with each step log line
    dataloader_drop_last: Bool = False  # zeromem.deepspeed.initialize's training loader
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None  # "zeromem" logger

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @property
    def monitoring(self) -> bool:
        """Whether any monitor writes metrics."""
        return self.csv_monitor.enabled or self.tensorboard.enabled or self.wandb.enabled
