"""Step time of a setup from the figures `calibrate` measured on this machine.

`Calibration.step_time` predicts one optimizer step of a setup from those figures and
the engine's layout (`shape_memory.exact_model_states`): the collectives it issues
(counted as the engine issues them, see `collectives`), the optimizer step over
the rank's elements, the offload traffic, and the engine's overhead for the
model's number of parameters. With gloo (CPU ranks) the cores run compute,
collectives and the step in turn, so the prediction is the sum, and
`StepTime.overlapped` equals `.serial`; the one exception measured is stage 3's
prefetched gathers, which gloo's worker thread runs while the main thread
computes (`comm_seconds`): the rank waits for none of that gather, but its core
still spends the worker's CPU time on it (`Calibration.beside`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner imports this module; its types are only annotations here
    from zeromem.planning.shape_memory import ActivationMemory, ModelShape, ShapeMemory, ZeroLayout
    from zeromem.planning.planner import Setup, StepTime, Workload

FP32 = 4
KINDS = ("all_reduce", "reduce_scatter", "all_gather")
# Comm's name for a kind -> the link it runs on
LINK_OF = {"all_reduce_norm": "all_reduce", "all_gather_forward": "all_gather",
           "all_gather_backward": "all_gather"}


@dataclass(frozen=True)
class Link:
    """t = latency + bytes / bandwidth."""

    latency: float  # seconds per call
    bandwidth: float  # bytes per second

    def seconds(self, calls: float, nbytes: float) -> float:
        return calls * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Calibration:
    """What this machine achieves, per rank, with `world_size` ranks of `backend` running."""

    backend: str
    world_size: int
    tokens: int  # per forward measured (micro-batch x sequence)
    forward_s: float
    backward_s: float
    flops: float  # achieved FLOP/s of forward + backward
    collectives: dict[str, Link]
    copy_bandwidth: float  # bytes/s host <-> device (read + write counted once)
    disk_read: float  # bytes/s, swap I/O under `disk_path`
    disk_write: float
    disk_path: str
    optimizer: dict[str, float] = field(default_factory=dict)  # "device" / "cpu": s per element
    overhead: dict[int, float] = field(default_factory=dict)  # stage: s per parameter and step
    overhead_per_element: dict[int, float] = field(default_factory=dict)  # stage: s per element
    # where the ranks computed: `calibrate` builds the model on the CPU, so the host is the
    # device and the engine skips the host copies it makes for a GPU (`offload_traffic`)
    device: str = "cpu"
    # CPU seconds a gather run beside compute still takes from its rank's core, per call and
    # byte gathered (gloo: its worker threads copy on the host, on the cores the ranks compute
    # on); None: it takes none (NCCL, where the GPU gathers while the host waits)
    beside: Link | None = None

    def describe(self) -> str:
        mb = 1e6
        links = ", ".join(f"{k} {v.latency * 1e6:.0f} us + {v.bandwidth / mb:.0f} MB/s"
                          for k, v in self.collectives.items())
        disk = (f"disk ({self.disk_path}) read {self.disk_read / mb:.0f} MB/s, "
                f"write {self.disk_write / mb:.0f} MB/s")
        return (f"measured on this machine ({self.world_size} {self.backend} ranks): "
                f"{self.flops / 1e9:.2f} GFLOP/s per rank (forward {self.forward_s * 1e3:.0f} ms, "
                f"backward {self.backward_s * 1e3:.0f} ms at {self.tokens} tokens); {links}; "
                f"copies {self.copy_bandwidth / mb:.0f} MB/s; {disk}; AdamW "
                + ", ".join(f"{k} {v * 1e9:.1f} ns" for k, v in self.optimizer.items())
                + " per element; engine overhead per parameter "
                + ", ".join(f"stage {k} {v * 1e6:.0f} us" for k, v in self.overhead.items())
                + ", per element " + ", ".join(f"stage {k} {v * 1e9:.1f} ns"
                                              for k, v in self.overhead_per_element.items())
                + ("" if self.beside is None else
                   f"; a gather beside compute takes its rank's CPU {self.beside.latency * 1e6:.0f}"
                   f" us + bytes at {self.beside.bandwidth / mb:.0f} MB/s"))

    def to_dict(self) -> dict:
        return asdict(self)

    def step_time(self, shape: ModelShape, setup: Setup, layout: ZeroLayout, states: ShapeMemory,
                  acts: ActivationMemory, work: Workload, n_d: int) -> StepTime:
        """The planner's `StepTime` of `setup` on this machine (see the module docstring)."""
        from zeromem.planning.planner import DTYPE_BYTES, StepTime, model_flops
        gas = work.gas
        compute = gas * model_flops(shape, work) / self.flops
        if setup.checkpointing != "none":  # one more forward per micro-step
            compute += gas * self.forward_s * (work.micro_batch * work.seq / self.tokens)
        p = DTYPE_BYTES[work.dtype]
        forward = gas * self.forward_s * (work.micro_batch * work.seq / self.tokens)
        comm = comm_seconds(self.collectives, shape, layout, p, n_d, gas,
                            (forward, max(compute - forward, 0.0)), self.beside)
        shard = shape.psi / n_d if setup.stage >= 1 else shape.psi
        placement = {"none": "device"}.get(setup.offload_optimizer, "cpu")
        optimizer = shard * self.optimizer[placement]
        overhead = gas * (len(shape.param_numels) * self.overhead.get(setup.stage, 0.0)
                          + shape.psi * self.overhead_per_element.get(setup.stage, 0.0))
        return StepTime(compute, comm, self._offload(setup, states, p, shape.psi / n_d, gas),
                        optimizer, can_overlap=self.backend == "nccl", overhead=overhead)

    def _offload(self, setup: Setup, states: ShapeMemory, p: int, shard: float, gas: int) -> float:
        """Host copies and swap I/O of one step."""
        moved = offload_traffic(setup, states, p, shard, gas, device_is_host=self.device == "cpu")
        disk = moved.read / self.disk_read + moved.written / self.disk_write
        return moved.copies / self.copy_bandwidth + disk


@dataclass(frozen=True)
class Traffic:
    """Bytes one optimizer step moves between device, host and swap files, per rank."""

    copies: float = 0.0  # host <-> device
    read: float = 0.0  # from the swap files
    written: float = 0.0  # to them


def offload_traffic(setup: Setup, states: ShapeMemory, param_bytes: int, shard: float,
                    gas: int, device_is_host: bool = False) -> Traffic:
    """What `setup`'s offload moves in one optimizer step, as the engine moves it (its
    per-step `offload.io_report()` counts the same swap bytes; test_plan_calibrate).
    `states.nvme`: the swap files' contents by name; `shard`: elements per rank;
    `device_is_host`: the ranks compute on the CPU, where host memory is device memory."""
    p = param_bytes
    copies, read, written = 0.0, 0.0, 0.0
    if setup.offload_optimizer == "cpu":
        # the reduced gradient shard to host (on a CPU device an fp32 one is used where it
        # is: offload/masters.HostGrads), the updated parameters back into the shard
        grad = 0 if device_is_host and p == FP32 else FP32
        copies += (grad + p) * shard
    if setup.offload_optimizer == "nvme":
        swapped = states.nvme.get("optimizer_states", 0) + states.nvme.get("masters", 0)
        read += swapped
        written += swapped
        grads = states.nvme.get("grads", 0)
        written += grads * gas  # each micro-step's reduced shard
        # read back by each micro-step's accumulation but the first, and once by the
        # step; the clipping norm reads nothing (GradFile.square, kept as shards are written)
        read += grads * gas
        copies += FP32 * shard  # the gradient into the step's buffer
    if setup.offload_param == "cpu" and not device_is_host:  # a CPU device gathers from
        copies += 2 * gas * p * shard  # the host shard itself; else fetched for forward and backward
    if setup.offload_param == "nvme":
        read += 2 * gas * p * shard
        written += p * shard
    return Traffic(copies, read, written)


def collectives(shape: ModelShape, layout: ZeroLayout, param_bytes: int, grad_bytes: int, n_d: int,
                gas: int) -> dict[str, tuple[float, float]]:
    """{kind: (calls, bytes)} one optimizer step issues, as the engine issues them.

    Flat groups as `shape_memory.exact_model_states` lays them out. Stage 0: one
    all-reduce per group at the boundary; stage 1: one reduce-scatter per group at
    the boundary; stage 2: one per group every micro-step; stages 1-2: then one
    all-gather of the updated shards per group (chunked by allgather_bucket_size).
    Stage 3: every micro-step, each fetch unit at or over the persistence threshold
    is gathered for forward and again for backward, and every unit's gradient is
    reduce-scattered; after the step, the persistent units are gathered once (Comm
    files that under the forward's gathers). Stages
    1-3 add one scalar all-reduce (the gradient norm, "all_reduce_norm"). The kinds
    are named as `Comm` counts them.
    """
    from zeromem.layout import padded_numel
    from zeromem.planning.shape_memory import reduce_buckets
    grad = grad_bytes
    if layout.stage >= 3:
        units = [padded_numel(n, n_d) for n in shape.unit_numels]
        fetched = [n for n, raw in zip(units, shape.unit_numels)
                   if raw >= layout.persistence_threshold]
        kept = [n for n, raw in zip(units, shape.unit_numels)
                if raw < layout.persistence_threshold]
        return {"all_gather_forward": (gas * len(fetched) + len(kept),
                                       param_bytes * (gas * sum(fetched) + sum(kept))),
                "all_gather_backward": (gas * len(fetched), param_bytes * gas * sum(fetched)),
                "reduce_scatter": (gas * len(units), gas * grad * sum(units)),
                "all_reduce_norm": (1, FP32)}
    groups = [padded_numel(n, n_d) for n in reduce_buckets(shape.param_numels,
                                                          layout.reduce_bucket_numel)]
    if layout.stage == 0:
        return {"all_reduce": (len(groups), grad * sum(groups))}
    times = gas if layout.stage == 2 else 1
    chunks = sum(-(-n // layout.allgather_bucket_numel) for n in groups)
    return {"reduce_scatter": (times * len(groups), times * grad * sum(groups)),
            "all_gather": (chunks, param_bytes * sum(groups)), "all_reduce_norm": (1, FP32)}


def prefetched_gathers(shape: ModelShape, layout: ZeroLayout, param_bytes: int, n_d: int,
                       gas: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(calls, bytes) of the stage-3 gathers the engine issues ahead of need, in the
    forward and in the backward of one optimizer step: with a prefetch window
    (`stage3_prefetch_bucket_size` > 0) every fetched unit but the first of each pass
    is gathered while the unit before it computes (stage3/fetch.py). The backward
    starts from the forward's last unit."""
    from zeromem.layout import padded_numel
    if layout.stage < 3 or layout.prefetch_numel <= 0:
        return (0.0, 0.0), (0.0, 0.0)
    fetched = [padded_numel(n, n_d) for n in shape.unit_numels
               if n >= layout.persistence_threshold]
    if len(fetched) < 2:
        return (0.0, 0.0), (0.0, 0.0)
    calls = gas * (len(fetched) - 1)
    return ((calls, param_bytes * gas * (sum(fetched) - fetched[0])),
            (calls, param_bytes * gas * (sum(fetched) - fetched[-1])))


def comm_seconds(links: dict[str, Link], shape: ModelShape, layout: ZeroLayout, param_bytes: int, n_d: int,
                 gas: int, compute: tuple[float, float], beside: Link | None = None) -> float:
    """Seconds one optimizer step spends on its collectives: every call the engine issues
    (`collectives`, at the measured links), less the prefetched stage-3 gathers, each
    pass's up to that pass's compute (`compute`: forward and backward seconds), plus the
    CPU time the hidden part still takes from the rank (`beside`; None: nothing).

    Measured on this machine (2 gloo ranks, demo GPT, each phase net of load): the
    prefetched gathers run on gloo's worker thread while the main thread computes
    (forward 63 ms with prefetch, 85 ms without, 53 ms with no engine), so the sum
    of everything in turn overstates stage 3 by most of its gathers. They are not
    free, though: each rank computes on one core of its own (OMP_NUM_THREADS=1, as
    many ranks as cores), and the worker thread's copies take their CPU time from
    that core: gloo's threads spend 0.35-0.6 ms of CPU per MB gathered, against the
    gather's 0.8 ms of wall time (calibrate.Probe's "all_gather_cpu", three loaded runs),
    and leaving it out under-predicted stage 3 by 5-11 % on the idle machine. The CPU
    time is what a hidden gather costs, not its wall time: the rest of that is waiting
    for the other rank and the socket, which leaves the core to compute. On a GPU (NCCL,
    `beside` None) the gather runs on the device while the host queues compute:
    the hidden part costs nothing. The gradient reductions the other stages launch
    during backward (overlap_comm) do not hide on gloo (stage 0's backward grows by
    about its all-reduces: gloo reduces on the CPU), and stay whole.
    """
    calls = collectives(shape, layout, param_bytes, param_bytes, n_d, gas)
    total = sum(links[LINK_OF.get(kind, kind)].seconds(c, nbytes)
                for kind, (c, nbytes) in calls.items())
    gather = links["all_gather"]
    for (c, nbytes), seconds in zip(prefetched_gathers(shape, layout, param_bytes, n_d, gas),
                                    compute):
        whole = gather.seconds(c, nbytes)
        hidden = min(whole, seconds)
        total -= hidden
        if beside is not None and hidden > 0:  # the hidden share of the worker's CPU time
            total += beside.seconds(c, nbytes) * hidden / whole
    return total
