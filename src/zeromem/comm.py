"""Every collective zeromem issues, with a ledger of the bytes each one moves.

All communication goes through `Comm`, which wraps one process group (passed in,
never fetched). Async calls return a `Pending` handle that the caller stores and
waits on explicitly. Bytes are counted per rank as the algorithm sends them
(ZeRO paper, section 7): a ring all-reduce sends 2(N-1)/N of its input, a
reduce-scatter or an all-gather (N-1)/N of the full buffer.

Each count is split into intra-node and inter-node bytes from the node layout
(hybrid/mesh.py): a collective is modelled as each rank sending an equal share of its
bytes to every peer of the group (direct all-to-all; gloo's reduce-scatter here is
one), so the inter-node part is the fraction of the group's peers on other nodes.
A group within one node (hpZ's secondary group, a node's reduce-scatter) crosses
nothing; a group of one rank per node (the replica group) crosses with all of it.
Several `Comm`s over sub-groups (`Comm.sub`) write into one shared `CommLedger`.

Reduce-scatter is chosen per backend. NCCL has a real one. gloo's
`reduce_scatter_tensor` is an all-reduce underneath (it sends as many bytes as an
all-reduce of the same input), so on gloo we run an all-to-all of the chunks
followed by a local sum, which sends half as much.

Gradient buckets are launched through the `Comm` their owners hold (the flat groups'
shard group): in bucket order on every rank, with a bound on the full-size buckets
alive (`schedule_reductions`, below). The order in which collectives are issued, and
how many of their buffers are alive, are the communication schedule: they live
beside the CB figure the same buffers are counted in.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from zeromem.hybrid.mesh import NodeLayout
from zeromem.layout import BUCKETS_ALIVE

# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases have the old names.
if TYPE_CHECKING:
    from zeromem.monitoring.comm_log import CommLog

_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_copies(backend: str) -> int:
    """Input-sized receive buffers a reduce-scatter allocates on `backend` (noted as CB):
    NCCL reduces in place, none; gloo's all-to-all of the chunks lands them in one before
    the local sum (`Comm._reduce_scatter`). The planner sizes buffers with this too."""
    return 0 if backend == "nccl" else 1


@dataclass
class CommReport:
    """Bytes sent by this rank per collective kind, for the last step and in total.

    `last_step` / `total` count all bytes; `last_step_inter` / `total_inter` the part
    sent to ranks on other nodes (the rest stayed within the node).
    """

    last_step: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    last_step_inter: dict[str, int] = field(default_factory=dict)
    total_inter: dict[str, int] = field(default_factory=dict)

    def split(self, kind: str, last_step: bool = True) -> tuple[int, int]:
        """(intra-node, inter-node) bytes of `kind`, for the last step or in total."""
        every, inter = ((self.last_step, self.last_step_inter) if last_step
                        else (self.total, self.total_inter))
        return every.get(kind, 0) - inter.get(kind, 0), inter.get(kind, 0)

    def to_dict(self) -> dict:
        return {"last_step": dict(self.last_step), "total": dict(self.total), "steps": self.steps,
                "last_step_inter": dict(self.last_step_inter),
                "total_inter": dict(self.total_inter)}

    def __str__(self) -> str:
        kinds = sorted(set(self.last_step) | set(self.total))
        rows = [f"{'collective':<22}{'last step (MB)':>16}{'of it inter-node':>18}"
                f"{'total (MB)':>14}"]
        rows += [f"{k:<22}{self.last_step.get(k, 0) / 1e6:>16.3f}"
                 f"{self.last_step_inter.get(k, 0) / 1e6:>18.3f}{self.total.get(k, 0) / 1e6:>14.3f}"
                 for k in kinds]
        return "\n".join(rows)


class CommLedger:
    """Bytes sent per collective kind, all and inter-node, per step and in total.

    One per engine, shared by the `Comm`s of its sub-groups, so one report covers them.
    """

    def __init__(self) -> None:
        self.step_bytes: dict[str, float] = defaultdict(float)
        self.step_inter: dict[str, float] = defaultdict(float)
        self.total_bytes: dict[str, float] = defaultdict(float)
        self.total_inter: dict[str, float] = defaultdict(float)
        self.last_step: dict[str, int] = {}
        self.last_inter: dict[str, int] = {}
        self.steps = 0

    def count(self, kind: str, nbytes: float, inter_fraction: float) -> None:
        """`nbytes` sent by this rank, `inter_fraction` of them to other nodes."""
        for every, inter in ((self.step_bytes, self.step_inter),
                             (self.total_bytes, self.total_inter)):
            every[kind] += nbytes
            inter[kind] += nbytes * inter_fraction

    def end_step(self) -> None:
        self.last_step = {k: round(v) for k, v in self.step_bytes.items()}
        self.last_inter = {k: round(v) for k, v in self.step_inter.items()}
        self.step_bytes.clear()
        self.step_inter.clear()
        self.steps += 1

    def report(self) -> CommReport:
        return CommReport(dict(self.last_step), {k: round(v) for k, v in self.total_bytes.items()},
                          self.steps, dict(self.last_inter),
                          {k: round(v) for k, v in self.total_inter.items()})


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a rank stopped answering (named when it can be known)."""


class Pending:
    """An in-flight collective; `wait()` blocks, then runs the finishing step (if any)."""

    def __init__(self, work: dist.Work | None, finish: Callable[[], None] | None = None,
                 explain: Callable[[RuntimeError], RuntimeError] | None = None,
                 forget: Callable[[dist.Work], None] | None = None):
        self.work = work
        self.finish = finish
        self.explain = explain  # turns a timeout into an error naming the silent ranks
        self.forget = forget  # the Comm that tracks `work` drops it (and its tensors) once done

    def wait(self, timeout=None) -> None:
        """Block until done; `timeout` (a timedelta) raises RuntimeError when exceeded."""
        if self.work is not None:
            try:
                if timeout is None:
                    self.work.wait()
                else:
                    self.work.wait(timeout)
            except RuntimeError as error:
                if self.explain is None or timeout is not None:  # the caller diagnoses its own
                    raise
                raise self.explain(error) from error
            if self.forget is not None:
                self.forget(self.work)
            self.work = None
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


def done() -> Pending:
    """A collective with nothing left to wait for (world size 1, or already completed).

    A new object each time: a shared one would be one module-level mutable object, and
    wrapping its `finish` (as `_logged` does) would change it for every caller."""
    return Pending(None)


class Reduction(Protocol):
    """What gradient buffers reduce with: a `Comm`, or a two-level reduction (hybrid/hierarchy.py)."""

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       async_op: bool = False) -> Pending: ...

    def note_buffer(self, tensor: torch.Tensor) -> None: ...

    def release_buffer(self, tensor: torch.Tensor) -> None: ...


@runtime_checkable
class AllReduction(Reduction, Protocol):
    """A reduction that also all-reduces (stage 0's whole gradient): a `Comm`, or hpZ's
    replicated reduction; qgZ's quantized one only reduce-scatters."""

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Pending: ...


class Comm:
    """Collectives over one data-parallel process group, with byte accounting."""

    def __init__(self, group: dist.ProcessGroup | None = None, store=None,
                 layout: NodeLayout | None = None, ledger: CommLedger | None = None):
        self.group = group
        self.store = store  # the default group's store: names silent ranks after a timeout
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.backend = dist.get_backend(group) if dist.is_initialized() else "none"
        # global ranks of the group, and the node layout that splits the ledger's bytes
        self.ranks = (dist.get_process_group_ranks(group) if dist.is_initialized() and group
                      is not None else list(range(self.world_size)))
        self.layout = layout
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0  # in the default group
        # whether the group is every rank of the job (hybrid sharding and ZeRO++ need that)
        self.spans_world = len(self.ranks) == (dist.get_world_size() if dist.is_initialized() else 1)
        self.inter_fraction = layout.off_node_fraction(self.ranks, self.global_rank) if layout else 0.0
        self.ledger = ledger or CommLedger()
        self.children: list[Comm] = []  # Comms over sub-groups, closed with this one
        self.buffer_bytes = 0  # temporary communication buffers alive now (CB)
        self.buffer_bytes_peak = 0
        # Every async Work not yet known finished, with the tensors it reads or writes.
        # A gloo worker thread that drops the last reference to a finished Work frees its
        # tensors, which needs the GIL; during interpreter shutdown that is a C++ terminate
        # (SIGABRT). So `close()` waits for each of them and drops them here, in Python.
        self._in_flight: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []
        self._closed = False
        self._log: CommLog | None = None  # `comms_logger`: each collective's size and latency
        self._parent: Comm | None = None  # set by `sub`: the parent's log records ours too
        # gradient buckets (`schedule_reductions`): none until the engine schedules them
        self._reduction: Reduction = self  # what the buckets reduce with (CommPlan.grads)
        self._bucket_count = 0  # buckets (flat groups); every one is handed in when reducing
        self.max_buckets = BUCKETS_ALIVE  # full-size buckets alive, filling or reducing
        self._overlap = True  # overlap_comm: reductions run while backward goes on
        self._reducing = False  # this backward reduces (a boundary, or every micro-step)
        self._next_bucket = 0  # buckets before it were launched in this backward
        self._waiting: dict[int, Callable[[Reduction], Pending]] = {}  # ready, not launched
        self._reductions: deque[Pending] = deque()  # launched, not yet waited for
        # most full-size buckets alive at once (one starting + reductions not yet waited for):
        # the bound `max_buckets` keeps, observable (a reduction not waited for holds its buffers)
        self.buckets_alive_peak = 0

    def sub(self, group: dist.ProcessGroup | None) -> Comm:
        """A Comm over `group` (a sub-group of this one's ranks) sharing this ledger."""
        child = Comm(group, self.store, self.layout, self.ledger)
        child._parent = self
        self.children.append(child)
        return child

    @property
    def log(self) -> CommLog | None:
        """The `comms_logger` of the root Comm: sub-groups' collectives are recorded there."""
        return self._parent.log if self._parent is not None else self._log

    @log.setter
    def log(self, value: CommLog | None) -> None:
        self._log = value

    @property
    def _steps(self) -> int:
        return self.ledger.steps

    # -- ledger ------------------------------------------------------------
    def _count(self, kind: str, nbytes: float) -> None:
        self.ledger.count(kind, nbytes, self.inter_fraction)

    def note_buffer(self, tensor: torch.Tensor) -> None:
        """Count a temporary communication buffer as alive (for the CB measurement)."""
        self.buffer_bytes += tensor.numel() * tensor.element_size()
        self.buffer_bytes_peak = max(self.buffer_bytes_peak, self.buffer_bytes)

    def release_buffer(self, tensor: torch.Tensor) -> None:
        self.buffer_bytes -= tensor.numel() * tensor.element_size()

    def end_step(self) -> None:
        """Close the current optimizer step in the ledger."""
        self.ledger.end_step()

    def report(self) -> CommReport:
        return self.ledger.report()

    # -- lifetime ------------------------------------------------------------
    def _track(self, work, *tensors: torch.Tensor):
        """Remember an async `work` and its tensors until it is seen finished (see __init__)."""
        if work is not None:
            self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]
            self._in_flight.append((work, tensors))
        return work

    def _forget(self, work) -> None:
        """`work` was waited on: its tensors are the caller's again (a gathered unit must be
        freed when it is resharded, not when the next collective is issued)."""
        self._in_flight = [(w, t) for w, t in self._in_flight if w is not work]

    def in_flight(self) -> int:
        """Async collectives issued and not yet seen finished."""
        return sum(not w.is_completed() for w, _ in self._in_flight)

    def close(self, barrier_timeout_s: float = 10.0) -> None:
        """Wait for every async collective, drop it and its tensors, then meet the other ranks.

        The barrier (bounded: a peer that died must not hold this rank) makes sure no
        rank leaves while another still runs a collective with it. `barrier_timeout_s`
        0 skips it (a rank that was told to stop).
        """
        if self._closed:
            return
        self._closed = True
        for child in self.children:  # their collectives first; one barrier below, over all
            child.close(barrier_timeout_s=0)
        pending, self._in_flight = self._in_flight, []
        for work, _ in pending:
            try:
                work.wait(timedelta(seconds=barrier_timeout_s or 1.0))
            except RuntimeError:  # a peer gone: nothing left to wait for
                pass
        del pending
        if self.world_size > 1 and barrier_timeout_s > 0 and dist.is_initialized():
            try:
                dist.barrier(group=self.group, async_op=True).wait(
                    timedelta(seconds=barrier_timeout_s))
            except RuntimeError:
                pass

    # -- gradient buckets: launch order and buckets alive --------------------------
    def schedule_reductions(self, reduction: Reduction, count: int, max_buckets: int,
                            overlap: bool = True) -> None:
        """Launch `count` gradient buckets per reducing backward, with `reduction`.

        Ranks must issue collectives in the same order even when their graphs differ (a
        parameter unused on one rank only), so buckets launch strictly in index order: a
        ready bucket waits for the ones before it. At most `max_buckets` full-size buckets
        are alive, filling or reducing: a bucket starts filling (`bucket_starts`) only when
        fewer than `max_buckets` reductions are in flight, and a launch first waits for the
        oldest until at most `max_buckets - 2` are (1: one bucket at a time, reduced shards
        to an NVMe file, offload/grad_file.py).

        The buckets' owners (the ZeRO optimizer's parameter hooks at stages 0-2, each
        stage-3 unit) hand in their launch when their bucket is complete
        (`reduce_in_order`); this runs launches, with `reduction`, and calls nothing else:
        no call goes back up to the owners' owners. Set once, by the engine.
        """
        self._reduction = reduction  # Comm, or a two-level reduction (hybrid/hierarchy.py)
        self._bucket_count = count
        self.max_buckets = max_buckets
        self._overlap = overlap

    @property
    def one_bucket_at_a_time(self) -> bool:
        """A single full-size bucket alive at once: no gradient may wait beside a reduction."""
        return self.max_buckets == 1

    def start_reductions(self, reducing: bool) -> None:
        """A backward begins; `reducing`: its buckets are launched (else they accumulate)."""
        self._reducing = reducing
        self._next_bucket = 0
        self._waiting.clear()

    def bucket_starts(self) -> None:
        """A full-size bucket is about to fill: at most `max_buckets` are alive."""
        if self._reducing:
            self._wait_reductions(self.max_buckets - 1)
            self.buckets_alive_peak = max(self.buckets_alive_peak, len(self._reductions) + 1)

    def reduce_in_order(self, index: int, launch: Callable[[Reduction], Pending]) -> None:
        """Bucket `index` is complete: `launch(reduction)` runs once those before it have."""
        if not self._reducing:
            return
        self._waiting[index] = launch
        while self._next_bucket in self._waiting:
            self._launch_bucket(self._waiting.pop(self._next_bucket))

    def launched(self, index: int) -> bool:
        """Was bucket `index`'s reduction launched in this backward?"""
        return self._reducing and index < self._next_bucket

    def finish_reductions(self) -> None:
        """Backward ended: wait for every reduction. Each bucket must have been handed in."""
        while self._reductions:
            self._reductions.popleft().wait()
        missed = self._reducing and self._next_bucket < self._bucket_count
        self._reducing = False
        if missed:  # its owner's gradients were never reduced: the step would read zeros
            raise RuntimeError(f"gradient bucket {self._next_bucket} of {self._bucket_count} "
                               "was never handed in for reduction in this backward")

    def _launch_bucket(self, launch: Callable[[Reduction], Pending]) -> None:
        self._wait_reductions(self.max_buckets - 2)
        pending = launch(self._reduction)
        self._next_bucket += 1
        if self._overlap:
            self._reductions.append(pending)
        else:
            pending.wait()

    def _wait_reductions(self, most: int) -> None:
        """Wait for the oldest reductions until at most `most` are in flight."""
        while len(self._reductions) > max(0, most):
            self._reductions.popleft().wait()

    # -- comms_logger (monitoring/comm_log.py) ------------------------------------------
    def _logged(self, collective: str, kind: str, nbytes: int, issue: Callable[[], Pending],
                async_op: bool) -> Pending:
        """Run `issue` and, with a log attached, record the collective when it completes."""
        token = self.log.start(collective, kind, nbytes) if self.log is not None else None
        pending = issue()
        if token is None:
            return pending
        if not async_op or (pending.work is None and pending.finish is None):  # done already
            self.log.finish(token)  # type: ignore[union-attr]
            return pending
        inner = pending.finish

        def finish() -> None:
            if inner is not None:
                inner()
            self.log.finish(token)  # type: ignore[union-attr]
        pending.finish = finish
        return pending

    # -- collectives -------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False,
                   kind: str = "all_reduce") -> Pending:
        """In-place all-reduce of `tensor`."""
        if self.world_size == 1:
            return done()
        n = self.world_size
        self._count(kind, 2 * (n - 1) / n * tensor.numel() * tensor.element_size())
        return self._logged("all_reduce", kind, tensor.numel() * tensor.element_size(),
                            lambda: self._handle(self._sync(lambda: dist.all_reduce(
                                tensor, op=op, group=self.group, async_op=async_op)), tensor),
                            async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       async_op: bool = False, kind: str = "reduce_scatter") -> Pending:
        """Sum `input` (N equal chunks) over ranks; this rank's chunk lands in `output`."""
        if self.world_size == 1:
            output.copy_(input)
            return done()
        return self._logged("reduce_scatter", kind, input.numel() * input.element_size(),
                            lambda: self._reduce_scatter(output, input, async_op, kind), async_op)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool,
                        kind: str) -> Pending:
        n = self.world_size
        self._count(kind, (n - 1) / n * input.numel() * input.element_size())
        if not reduce_scatter_copies(self.backend):
            return self._handle(_reduce_scatter_tensor(output, input, group=self.group,
                                                       async_op=async_op), output, input)
        # gloo: all-to-all of the chunks, then sum the N chunks that arrived here.
        received = torch.empty_like(input)
        self.note_buffer(received)
        work = self._track(self._sync(lambda: dist.all_to_all_single(
            received, input, group=self.group, async_op=async_op)), received, input)

        def finish() -> None:
            torch.sum(received.view(n, -1), dim=0, out=output)
            self.release_buffer(received)

        pending = Pending(work if async_op else None, finish, self.explain, self._forget)
        if not async_op:
            pending.wait()
        return pending

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   kind: str = "all_gather") -> Pending:
        """Concatenate every rank's `input` into `output` (N times its size)."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return done()
        n = self.world_size
        self._count(kind, (n - 1) / n * output.numel() * output.element_size())
        return self._logged("all_gather", kind, output.numel() * output.element_size(),
                            lambda: self._handle(self._sync(lambda: _all_gather_tensor(
                                output, input, group=self.group, async_op=async_op)), output, input),
                            async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   kind: str = "all_to_all") -> None:
        """Chunk i of `input` (N equal chunks) goes to rank i; rank j's lands in chunk j of
        `output`. Blocking."""
        if self.world_size == 1:
            output.copy_(input)
            return
        n = self.world_size
        self._count(kind, (n - 1) / n * input.numel() * input.element_size())
        self._sync(lambda: dist.all_to_all_single(output, input, group=self.group))

    def broadcast(self, tensor: torch.Tensor, src_rank: int, async_op: bool = False) -> Pending:
        """Broadcast from group rank `src_rank`."""
        if self.world_size == 1:
            return done()
        self._count("broadcast", tensor.numel() * tensor.element_size() * (self.rank == src_rank))
        src = dist.get_global_rank(self.group, src_rank) if self.group is not None else src_rank
        return self._logged("broadcast", "broadcast", tensor.numel() * tensor.element_size(),
                            lambda: self._handle(self._sync(lambda: dist.broadcast(
                                tensor, src=src, group=self.group, async_op=async_op)), tensor),
                            async_op)

    def barrier(self) -> None:
        if self.world_size > 1:
            self._sync(lambda: dist.barrier(group=self.group))

    def _handle(self, work, *tensors: torch.Tensor) -> Pending:
        """Async: a tracked handle. Sync (work None): already done, or raised (explained)."""
        return Pending(self._track(work, *tensors), explain=self.explain,
                       forget=self._forget) if work is not None else done()

    def _sync(self, run: Callable[[], object]):
        """Run a blocking collective; a timeout becomes a CollectiveTimeoutError."""
        try:
            return run()
        except RuntimeError as error:
            raise self.explain(error) from error

    def explain(self, error: RuntimeError, answer_s: float = 3.0) -> RuntimeError:
        """Name the ranks that stopped answering: each rank that times out says so in the
        store; the ranks that do not say so within `answer_s` are the silent ones."""
        if self.store is None or "timed out" not in str(error).lower():
            return error
        me = self.global_rank
        key = f"zeromem/timed_out/{self._steps}/{{}}"
        self.store.set(key.format(me), "1")
        others = [r for r in range(dist.get_world_size()) if r != me]
        try:
            self.store.wait([key.format(r) for r in others], timedelta(seconds=answer_s))
        except RuntimeError:  # some ranks did not time out: they are the silent ones
            pass
        silent = [r for r in others if not self.store.check([key.format(r)])]
        who = (f"rank(s) {silent} stopped answering (they did not time out themselves: "
               "frozen, or dead)" if silent else "every rank timed out (network or a hang)")
        return CollectiveTimeoutError(f"rank {me}: a collective at optimizer step "
                                      f"{self._steps} did not complete: {who}. Cause: {error}")
