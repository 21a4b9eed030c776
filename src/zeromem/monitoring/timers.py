"""Per-phase wall-clock timers (`wall_clock_breakdown`): forward, backward, optimizer step."""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch


class PhaseTimers:
    """Accumulates seconds per phase while enabled; `summary()` reports and resets them."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.sync = enabled and device.type == "cuda"  # kernels are async: time what they did
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start
            self.counts[phase] += 1

    def summary(self) -> str:
        """', forward 12.3 ms, ...' (mean per call since the last summary), or '' when off."""
        if not self.enabled:
            return ""
        parts = [f"{p} {1e3 * s / self.counts[p]:.1f} ms" for p, s in self.seconds.items()]
        self.seconds.clear()
        self.counts.clear()
        return ", " + ", ".join(parts)
