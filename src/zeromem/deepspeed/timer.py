"""`engine.tput_timer`: DeepSpeed's `utils.timer.ThroughputTimer`, as scripts read it.

DeepSpeed-Chat calls `tput_timer.update_epoch_count()` after each epoch; others read
`avg_samples_per_sec()` or the counters. The timer runs from each forward to the
`step()` after it, skipping the first `start_step` optimizer steps (warm-up), as
DeepSpeed's. zeromem's own step log line already reports samples per second
(`timers.throughput`), so this timer logs nothing.
"""
from __future__ import annotations

import time

import torch


class ThroughputTimer:
    """Counts epochs, micro-steps and optimizer steps, and times forward-to-step."""

    def __init__(self, batch_size: int, enabled: bool, synchronized: bool,
                 device: torch.device, start_step: int = 2):
        self.batch_size = batch_size  # samples per optimizer step, all ranks together
        self.enabled, self.synchronized, self.device = enabled, synchronized, device
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0  # since the epoch began
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # timed seconds from step start_step on
        self.started = False
        self._start_time = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """At a forward: the clock starts once the warm-up steps are done."""
        if not self.enabled:
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            self._sync()
            self._start_time = time.perf_counter()

    def stop(self, global_step: bool = False) -> None:
        """At `step()`: one micro-step more, and an optimizer step more at a boundary."""
        if not (self.enabled and self.started):
            return
        self.started = False
        self.micro_step_count += 1
        self.global_step_count += int(global_step)
        if self._start_time > 0:
            self._sync()
            self.total_elapsed_time += time.perf_counter() - self._start_time
            self._start_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples a second over the timed steps (-inf before any step, as DeepSpeed's)."""
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)

    def _sync(self) -> None:
        if self.synchronized and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
