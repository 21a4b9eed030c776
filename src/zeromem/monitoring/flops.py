"""`flops_profiler`: the flops and time of one training step, summarised as DeepSpeed does.

At optimizer step `profile_step` (1 = the first), every forward and backward of the
step's micro-steps runs under torch's `FlopCounterMode`, and the clock is read around
them (after a device synchronize). The summary, on rank 0 (to `output_file` or the
"zeromem" logger), gives DeepSpeed's lines:

    params, fwd MACs, fwd flops, bwd flops (counted, not DeepSpeed's 2 x fwd estimate),
    fwd / bwd / step / iteration latency and FLOPS, samples per second,
    DeepSpeed's estimate of the iteration: (3 + recompute_fwd_factor) x fwd flops,

and, when `detailed`, the `top_modules` modules with the most forward flops at each
depth of the module tree up to `module_depth` (-1: every depth). Flops are per rank
(DeepSpeed's "per GPU"); MACs are half the flops of matrix products.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

if TYPE_CHECKING:
    from zeromem.comm import Comm
    from zeromem.config.schema import Config
    from zeromem.training_state import StepCounters

log = logging.getLogger("zeromem")


def _number(value: float, unit: str = "") -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}".rstrip()


class FlopsProfiler:
    """Counts one optimizer step's flops (`profile_step`) and writes the summary."""

    def __init__(self, config: Config, comm: Comm, device: torch.device, psi: int,
                 counters: StepCounters):
        """`psi`: the trained parameters; `counters`: the engine's, read to find the profiled step."""
        self.run_config, self.config = config, config.flops_profiler
        self.comm, self.device, self.psi, self.counters = comm, device, psi, counters
        self.flops: dict[str, float] = defaultdict(float)  # phase -> flops
        self.seconds: dict[str, float] = defaultdict(float)  # phase -> seconds
        self.modules: dict[str, float] = defaultdict(float)  # forward flops by module name
        self.last_backward_end = 0.0
        self.result: dict | None = None  # the summary's numbers, once written

    def profiling(self) -> bool:
        return self.result is None and self.counters.global_steps + 1 == self.config.profile_step

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count and time the forward or backward inside (only during the profiled step)."""
        if not self.profiling():
            yield
            return
        self._sync()
        start = time.perf_counter()
        with FlopCounterMode(display=False) as counter:  # every module's count: depth is display
            yield
        self._sync()
        end = time.perf_counter()
        self.seconds[name] += end - start
        self.flops[name] += counter.get_total_flops()
        if name == "forward":
            for module, ops in counter.get_flop_counts().items():
                if module != "Global":
                    self.modules[module] += sum(ops.values())
        else:
            self.last_backward_end = end

    def after_step(self) -> None:
        """After each optimizer step: at the profiled one, write the summary."""
        if self.result is not None or self.counters.global_steps != self.config.profile_step:
            return
        self._sync()
        self.seconds["step"] = time.perf_counter() - self.last_backward_end
        self.result = self._numbers()
        if self.comm.rank == 0:
            text = self.summary()
            if self.config.output_file:
                with open(self.config.output_file, "w") as handle:
                    handle.write(text + "\n")
            else:
                log.info("%s", text)

    def _numbers(self) -> dict:
        config = self.run_config
        fwd, bwd = self.flops["forward"], self.flops["backward"]
        latency = {k: self.seconds[k] for k in ("forward", "backward", "step")}
        iteration = sum(latency.values())
        return {
            "step": config.flops_profiler.profile_step, "world_size": self.comm.world_size,
            "micro_batch": self.counters.batch.micro,
            "samples": self.counters.batch.micro * self.counters.batch.accumulation,
            "params": self.psi, "fwd_flops": fwd, "fwd_macs": fwd / 2, "bwd_flops": bwd,
            "latency_s": {**latency, "iteration": iteration},
            "deepspeed_estimate_flops": (3 + self.config.recompute_fwd_factor) * fwd,
            "modules": dict(self.modules),
        }

    def _module_lines(self) -> list[str]:
        if not self.config.detailed or not self.modules:
            return []
        depth_of = {name: name.count(".") for name in self.modules}
        deepest = max(depth_of.values())
        last = deepest if self.config.module_depth < 0 else min(deepest, self.config.module_depth)
        total = max(self.flops["forward"], 1.0)
        lines = ["", f"Top {self.config.top_modules} modules by forward flops, per depth:"]
        for depth in range(last + 1):
            ranked = sorted((f, n) for n, f in self.modules.items() if depth_of[n] == depth)[::-1]
            shown = ", ".join(f"{name} {_number(flops)} ({100 * flops / total:.1f}%)"
                              for flops, name in ranked[:self.config.top_modules])
            lines.append(f"depth {depth}: {shown}")
        return lines

    def summary(self) -> str:
        """DeepSpeed's profile summary for the numbers of the profiled step."""
        r = self.result
        assert r is not None
        lat = r["latency_s"]

        def rate(flops: float, seconds: float) -> str:
            return _number(flops / seconds if seconds > 0 else 0.0, "FLOPS")
        rows = [
            ("world size", str(r["world_size"])), ("batch size per rank", str(r["micro_batch"])),
            ("params per rank", _number(r["params"])),
            ("fwd MACs per rank", _number(r["fwd_macs"], "MACs")),
            ("fwd flops per rank", _number(r["fwd_flops"])),
            ("bwd flops per rank (counted)", _number(r["bwd_flops"])),
            ("fwd latency", f"{lat['forward'] * 1e3:.2f} ms"),
            ("fwd FLOPS per rank", rate(r["fwd_flops"], lat["forward"])),
            ("bwd latency", f"{lat['backward'] * 1e3:.2f} ms"),
            ("bwd FLOPS per rank", rate(r["bwd_flops"], lat["backward"])),
            ("step latency", f"{lat['step'] * 1e3:.2f} ms"),
            ("iter latency", f"{lat['iteration'] * 1e3:.2f} ms"),
            ("FLOPS per rank", rate(r["fwd_flops"] + r["bwd_flops"], lat["iteration"])),
            ("samples/second", f"{r['samples'] / max(lat['iteration'], 1e-9):.2f}"),
            (f"DeepSpeed's estimate, (3 + {self.config.recompute_fwd_factor}) x fwd flops",
             _number(r["deepspeed_estimate_flops"])),
        ]
        head = f"{'-' * 26} zeromem flops profiler (step {r['step']}) {'-' * 26}"
        return "\n".join([head, *(f"{name + ':':<64}{value}" for name, value in rows),
                          *self._module_lines()])
