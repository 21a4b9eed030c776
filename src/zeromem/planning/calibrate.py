"""Step time from figures measured on this machine (`zeromem plan --calibrate`).

The planner's defaults (100 TFLOPS, 25 GB/s, ...) are assumptions about a GPU
cluster. `calibrate` replaces them with what this machine achieves, measured
on `world_size` spawned ranks of the backend in use, all running at once (as
in training, where they share the machine):

    compute     forward and backward of the model itself at the workload's
                micro-batch and sequence: achieved FLOP/s = the planner's FLOPs
                (6Ψ + 12·L·h·s per token) / the measured time
    collectives latency and bandwidth of each kind the engine issues
                (all-reduce, reduce-scatter, all-gather), through the engine's
                own `Comm`, fitted to a small and a large message:
                t = latency + bytes / bandwidth (bytes: the tensor reduced or
                gathered)
    beside      the CPU time gloo's own threads spend on those all-gathers (the
                process's CPU time less the calling thread's), fitted the same
                way: what a stage-3 gather prefetched beside compute still costs
                the core its rank computes on (`step_model.comm_seconds`)
    copies      host <-> device bandwidth (a CPU device: a memory copy)
    disk        read and write bandwidth of the engine's swap I/O (`SwapSpace`,
                O_DIRECT) under the NVMe path
    optimizer   seconds per element of AdamW's step with the kernel each
                placement runs: on the device the config's as `optim/factory.py` builds
                it (fused where torch has it), torch's fused CPU kernel under
                offload
    overhead    the engine's own cost per step at each stage: per parameter
                (Python hooks, bucket bookkeeping, launches) from a step of an
                engine over `ManyParameters` (many small parameters, almost no
                compute), per element (its passes over gradient buckets and
                shards: zeroing, accumulating, adding the reduced shard, the
                norm, unscaling) from one over `FewLargeParameters`; each less the
                same step without an engine and less the collectives that engine
                issues (counted as below, timed with the links above)

Every timing is taken by `Clock`: wall time less the run-queue delay of the timed
thread (the time other processes held its core; for a call that synchronises the
ranks, the largest delay over them), so that a calibration on a loaded machine
measures the machine, not the load; each figure is then the median of the samples.

The figures become a `step_model.Calibration`, whose `step_time` predicts a setup's step.
"""
from __future__ import annotations

import functools
import os
import socket
import statistics
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed
from torch import nn

from zeromem.planning.activation_trace import example_inputs, training_loss
from zeromem.planning.step_model import FP32, KINDS, Calibration, Link, comm_seconds

if TYPE_CHECKING:  # the planner imports this module; its types are only annotations here
    from zeromem.comm import Comm
    from zeromem.planning.shape_memory import ModelShape


def run_queue_delay() -> float:
    """Seconds the calling thread has waited, runnable, for a CPU another process held
    (the kernel's /proc/<pid>/task/<tid>/schedstat); 0.0 where the kernel does not say."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Clock:
    """Times a call on every rank at once, less the time other processes took its CPU.

    On a shared machine the load from other processes shows as run-queue delay of
    the timed thread: runnable, but another process on the core. Wall time less that
    delay is what the call costs on the machine to itself (to within the caches and
    memory bandwidth the others share), however loaded the machine was; `min` or a
    median of the wall times is not (with 2 cores and 5 busy processes, no call may
    run unloaded at all). A call that synchronises the ranks (a collective, an engine
    step) also waits out the other rank's delay, so the largest over the ranks is
    subtracted; a rank's own work (compute, copies, the optimizer, disk) loses its
    own. Only the timed (main) thread's delay is counted: gloo's and the swap I/O's
    worker threads spend most of their time blocked, and their load stays in both
    the calibration and the steps it predicts.
    """

    def __init__(self, comm: Comm):
        self.comm = comm

    def seconds(self, run: Callable[[], Any], reps: int = 1, synchronised: bool = True) -> float:
        """Median over `reps` of `run`'s seconds less the run-queue delay, all ranks
        starting together."""
        return statistics.median(wall - delay for wall, delay in
                                 (self.timed(run, synchronised) for _ in range(reps)))

    def timed(self, run: Callable[[], Any], synchronised: bool = True) -> tuple[float, float]:
        """(wall seconds, run-queue delay to subtract) of one `run`, all ranks starting
        together."""
        self.comm.barrier()
        delay, start = run_queue_delay(), time.perf_counter()
        run()
        wall, delay = time.perf_counter() - start, run_queue_delay() - delay
        return wall, self._largest(delay) if synchronised else delay

    def worker_cpu(self, run: Callable[[], Any], reps: int = 1) -> float:
        """Median over `reps` of the CPU seconds this process's other threads (gloo's
        workers) spend during `run`, all ranks starting together: the process's CPU time
        less the calling thread's, neither of which counts time another process held a
        core."""
        def once() -> float:
            self.comm.barrier()
            process, own = time.process_time(), time.thread_time()
            run()
            return (time.process_time() - process) - (time.thread_time() - own)
        return statistics.median(once() for _ in range(reps))

    def _largest(self, seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        self.comm.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return float(value.item())


class ManyParameters(nn.Module):
    """Many small parameters and almost no compute: what the engine itself costs per
    parameter (the `overhead` calibration)."""

    BLOCKS, WIDTH = 16, 8

    def __init__(self) -> None:
        super().__init__()
        w = self.WIDTH
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(w, w), nn.LayerNorm(w))
                                    for _ in range(self.BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


class FewLargeParameters(nn.Module):
    """Two large parameters and only elementwise compute: what the engine itself costs per
    element (the `overhead_per_element` calibration)."""

    ELEMENTS = 1 << 20

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.randn(self.ELEMENTS))
        self.second = nn.Parameter(torch.randn(self.ELEMENTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.mean()
        return (self.first * scale).square().mean() + (self.second * scale).square().mean()


STAGES = (0, 1, 2, 3)
OVERHEAD_MODELS = {"params": ManyParameters, "elements": FewLargeParameters}


def overhead_config(stage: int) -> dict:
    """The engine config `ManyParameters` is stepped under at `stage` (as the planner writes)."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "overlap_comm": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def _engine_seconds(seconds: Callable[[str], float], links: dict[str, Link], n: int,
                    name: str, stage: int) -> tuple[float, Any]:
    """(seconds of the engine's own work in one step of OVERHEAD_MODELS[name], its shape)."""
    from zeromem.config.schema import Config
    from zeromem.planning.planner import layout_for, shape_of
    with torch.device("meta"):
        shape = shape_of(OVERHEAD_MODELS[name]())
    layout = layout_for(Config.load(overhead_config(stage), world_size=n), shape, n)
    units = shape.with_unit_caps(layout.unit_caps(FP32, n))  # as the engine merges them
    comm = comm_seconds(links, units, layout, FP32, n, 1, (0.0, 0.0))  # almost no compute
    return seconds(f"{name}_{stage}") - seconds(f"{name}_none") - comm, shape


def _engine_overhead(seconds: Callable[[str], float], links: dict[str, Link],
                     n: int) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of the engine's own work per parameter and per element of a step, by stage:
    ManyParameters' is all per parameter; FewLargeParameters', less its parameters' share
    of that, per element."""
    per_param, per_element = {}, {}
    for stage in STAGES:
        own, shape = _engine_seconds(seconds, links, n, "params", stage)
        per_param[stage] = max(own, 0.0) / len(shape.param_numels)
        own, shape = _engine_seconds(seconds, links, n, "elements", stage)
        own -= per_param[stage] * len(shape.param_numels)
        per_element[stage] = max(own, 0.0) / shape.psi
    return per_param, per_element


@dataclass(frozen=True)
class Measurement:
    """What to measure (picklable: it travels to the spawned ranks)."""

    build: Callable[[], nn.Module]
    micro_batch: int
    seq: int
    vocab: int
    shard_numel: int  # elements the optimizer steps on one rank (sized like the real step)
    nvme_path: str
    reps: int

    def link_sizes(self, world_size: int) -> tuple[int, int]:
        """Elements of the small (latency) and large (bandwidth) collective messages."""
        n = world_size
        return 256 * n, max(1 << 16, min(self.shard_numel * n, 1 << 22)) // n * n

    @property
    def optimizer_numel(self) -> int:
        return max(1 << 16, min(self.shard_numel, 1 << 22))


class Probe:
    """One rank's instruments; `sample()` measures everything once.

    Built once, sampled in rounds: a benchmark interleaves the rounds with the
    steps it measures, so that load from other processes on a shared machine
    falls on both alike.
    """

    DISK_BYTES = 32 << 20
    RECORD = 1 << 20  # swap requests of 1 MiB, 4 in flight
    COPY = 1 << 22  # elements copied
    SMALL_REPS = 12  # calls of each small (latency) collective per sample

    def __init__(self, what: Measurement, rank: int):
        from zeromem.comm import Comm
        from zeromem.config.schema import AioConfig
        from zeromem.offload.nvme import AsyncIO, BufferPool, SwapSpace
        from zeromem.offload.placement import CPU_KERNEL
        from zeromem.optim.factory import kernel_options
        torch.manual_seed(rank)
        self.comm = Comm()
        self.clock = Clock(self.comm)
        n = self.comm.world_size
        self.model = what.build()
        # the batch the bench and the activation trace give it (images to a vision model)
        self.inputs = example_inputs(self.model, what.micro_batch, what.seq, what.vocab)
        self.links = {k: [self._link_op(k, m) for m in what.link_sizes(n)] for k in KINDS}
        self.copy = (torch.ones(self.COPY), torch.empty(self.COPY))
        numel = what.optimizer_numel
        self.optimizers = {}
        # the kernels the engine builds: on the device the config's AdamW as optim/factory.py asks
        # for it, under offload torch's fastest CPU kernel (offload/placement.py)
        kernels = {"device": kernel_options(torch.optim.AdamW, {"lr": 1e-4}),
                   "cpu": {"lr": 1e-4, CPU_KERNEL: True}}
        for name, options in kernels.items():
            p = nn.Parameter(torch.zeros(numel))
            p.grad = torch.full((numel,), 1e-3)
            self.optimizers[name] = torch.optim.AdamW([p], **options)
        self.overhead = self._overhead_steps()
        self.space = SwapSpace(what.nvme_path, rank, AsyncIO.from_config(AioConfig.model_validate({})))
        self.file = self.space.file("calibrate.swp", self.DISK_BYTES)
        self.pool = BufferPool(4, self.RECORD)
        self.bufs = list(self.pool.free)
        for buf in self.bufs:
            buf.fill_(1)
        self.sample()  # warm-up: allocations, lazy initialisation, the file's first write

    def _overhead_steps(self) -> dict[str, Callable[[], None]]:
        """One step of each of OVERHEAD_MODELS without an engine ("NAME_none") and under
        one at each stage ("NAME_S")."""
        import zeromem
        x = torch.randn(4, ManyParameters.WIDTH)
        steps: dict[str, Callable[[], None]] = {}
        self.engines = []
        for name, build in OVERHEAD_MODELS.items():
            bare = build()
            optimizer = torch.optim.AdamW(bare.parameters(), lr=1e-4, fused=True)

            def plain(bare: nn.Module = bare, optimizer: Any = optimizer) -> None:
                bare(x).backward()
                torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            steps[f"{name}_none"] = plain
            for stage in STAGES:
                engine = zeromem.initialize(build(), overhead_config(stage))
                self.engines.append(engine)

                def step(engine: Any = engine) -> None:
                    engine.backward(engine(x))
                    engine.step()
                steps[f"{name}_{stage}"] = step
        return steps

    def _link_op(self, kind: str, numel: int) -> Callable[[], Any]:
        comm, n = self.comm, self.comm.world_size
        x = torch.ones(numel)
        if kind == "all_reduce":
            return lambda: comm.all_reduce(x)
        if kind == "reduce_scatter":
            out = torch.empty(numel // n)
            return lambda: comm.reduce_scatter(out, x)
        shard = torch.ones(numel // n)
        return lambda: comm.all_gather(x, shard)

    def _disk(self, io: Callable) -> None:
        handles: list = []
        for i, offset in enumerate(range(0, self.DISK_BYTES, self.RECORD)):
            if len(handles) == 4:
                handles.pop(0).wait()
            handles.append(io(self.bufs[i % 4], offset))
        for h in handles:
            h.wait()

    def _loss(self) -> torch.Tensor:
        args, kwargs = self.inputs
        return training_loss(self.model(*args, **kwargs))

    def sample_compute(self) -> dict:
        """Seconds of one forward and backward of the model (a benchmark takes one beside
        each step it measures: the compute dominates, and the load moves within seconds)."""
        seconds = self.clock.seconds(lambda: self._loss().backward(),
                                     synchronised=False)
        self.model.zero_grad(set_to_none=True)
        return {"forward_backward": seconds}

    def sample(self) -> dict:
        """Seconds of each measurement, once (the small collectives: median of SMALL_REPS
        calls, since a latency of a few hundred microseconds is easily missed by a rank
        the scheduler delays; the engine's overhead steps and the CPU time of the large
        all-gather, which moves with what other processes do to the caches: median of 3)."""
        seconds = self.clock.seconds
        local = functools.partial(seconds, synchronised=False)  # each rank's own work

        def forward() -> None:
            with torch.no_grad():
                self._loss()

        out: dict[str, Any] = {"forward": local(forward), **self.sample_compute()}
        for kind, (small, large) in self.links.items():
            out[kind] = (seconds(small, self.SMALL_REPS), seconds(large))
        small, large = self.links["all_gather"]
        worker = self.clock.worker_cpu
        out["all_gather_cpu"] = (worker(small, self.SMALL_REPS), worker(large, 3))
        src, dst = self.copy
        out["copy"] = local(lambda: dst.copy_(src))
        for name, opt in self.optimizers.items():
            out["optimizer_" + name] = local(opt.step)
        out["disk_write"] = local(lambda: self._disk(self.file.write))
        out["disk_read"] = local(lambda: self._disk(self.file.read))
        for name, step in self.overhead.items():
            out[name] = seconds(step, 3, synchronised=not name.endswith("_none"))
        return out

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.space.close()


def _measure_rank(rank: int, world_size: int, what: Measurement) -> list[dict]:
    probe = Probe(what, rank)
    try:
        return [probe.sample() for _ in range(what.reps)]
    finally:
        probe.close()


def from_samples(samples: list[list[dict]], what: Measurement, shape: ModelShape,
                 backend: str = "gloo") -> Calibration:
    """The calibration from each rank's `Probe.sample()`s: per rank the median over the
    samples, then the slowest rank (a step waits for every rank). Each sample is already
    net of the load from other processes (`Clock`); the median takes out what is left
    of it (the caches and the worker threads the others slow down)."""
    from zeromem.planning.planner import Workload, model_flops

    def seconds(key: str, index: int | None = None) -> float:
        return max(statistics.median(s[key] if index is None else s[key][index] for s in rank)
                   for rank in samples)

    n = len(samples)
    sizes = what.link_sizes(n)
    links = {kind: _fit(sizes, seconds(kind, 0), seconds(kind, 1)) for kind in KINDS}
    # gloo gathers on the host's cores; NCCL on the GPU (`Calibration.beside`)
    beside = (_fit(sizes, seconds("all_gather_cpu", 0), seconds("all_gather_cpu", 1), 0.0)
              if backend == "gloo" else None)
    numel = what.optimizer_numel
    fwd, both = seconds("forward"), seconds("forward_backward")
    tokens = what.micro_batch * what.seq
    flops = model_flops(shape, Workload(what.micro_batch, what.seq))
    return Calibration(backend, n, tokens, fwd, max(both - fwd, 1e-9), flops / both, links,
                       FP32 * Probe.COPY / seconds("copy"),
                       Probe.DISK_BYTES / seconds("disk_read"),
                       Probe.DISK_BYTES / seconds("disk_write"), what.nvme_path,
                       {k: seconds("optimizer_" + k) / numel for k in ("device", "cpu")},
                       *_engine_overhead(seconds, links, n), beside=beside)


def _fit(sizes: tuple[int, int], small_s: float, large_s: float, least_latency: float = 1e-7) -> Link:
    """The link through (small message, `small_s`) and (large message, `large_s`); `sizes`:
    the two messages' elements."""
    small, large = sizes
    bandwidth = FP32 * (large - small) / max(large_s - small_s, 1e-9)
    return Link(max(small_s - FP32 * small / bandwidth, least_latency), bandwidth)


def measurement(build: Callable[[], nn.Module], shape: ModelShape, micro_batch: int, seq: int,
                world_size: int, nvme_path: str | None = None, reps: int = 3) -> Measurement:
    """What `calibrate` measures for `shape` (the disk: `nvme_path`'s, else the temp dir's)."""
    return Measurement(build, micro_batch, seq, shape.vocab or 256,
                       -(-shape.psi // world_size), nvme_path or tempfile.gettempdir(), reps)


def calibrate(build: Callable[[], nn.Module], shape: ModelShape, micro_batch: int, seq: int,
              world_size: int, nvme_path: str | None = None, reps: int = 3,
              backend: str = "gloo", timeout_s: float = 600) -> Calibration:
    """Measure this machine on `world_size` spawned `backend` ranks (see the module docstring).

    `build()` makes the real model on the CPU (a picklable callable: a module-level
    function or a `functools.partial` of one); `shape` is its planner shape. The disk
    measured is `nvme_path`'s, else the temporary directory's.
    """
    what = measurement(build, shape, micro_batch, seq, world_size, nvme_path, reps)
    samples = run_ranks(_measure_rank, world_size, (what,), backend, timeout_s)
    return from_samples(samples, what, shape, backend)


# ---------------------------------------------------------------- spawning ranks

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple,
               queue: Any) -> None:
    import torch.distributed as dist
    # as torchrun sets them (DeepSpeed's initialize, which `zeromem bench` runs, reads them)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    finished = False
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
        finished = True
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import zeromem
        zeromem.shutdown(barrier_timeout_s=10 if finished else 0)  # collectives drained first
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, args: tuple, backend: str = "gloo",
              timeout_s: float = 600) -> list:
    """`fn(rank, world_size, *args)` on `world_size` spawned ranks; their results by rank."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores, as in training
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, backend, fn, args, queue),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not finish in {timeout_s:.0f} s")
            if queue.empty():
                if not any(p.is_alive() for p in procs) and queue.empty():
                    raise RuntimeError("the ranks exited without a result")
                time.sleep(0.05)
                continue
            rank, status, value = queue.get()
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
