"""`comms_logger`: every collective's size and latency, summarised the way DeepSpeed does.

`Comm` (comm.py) already counts the bytes each kind of collective sends (its ledger);
with a `CommLog` attached it also records each collective as it completes: DeepSpeed's
op name, zeromem's ledger kind, the message size (the whole buffer: an all-gather's
output, a reduce-scatter's input, the tensor of an all-reduce or broadcast) and the
latency from issue to completion (an async collective completes when it is waited on).

`summary()` is DeepSpeed's `deepspeed.comm.log_summary()` table: per op and message
size, the count, total and average latency, and the algorithm and bus bandwidths
(deepspeed/utils/comms_logging.py's formulas). `verbose` logs every collective;
`debug` adds the calling function; `prof_all: false` records only the ops in
`prof_ops` (DeepSpeed op names, or zeromem ledger kinds).
"""
from __future__ import annotations

import logging
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

log = logging.getLogger("zeromem")

# zeromem's collective -> DeepSpeed's name for it (deepspeed.comm)
DEEPSPEED_OPS = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
                 "all_gather": "all_gather_into_tensor", "broadcast": "broadcast"}


@dataclass
class Record:
    op: str  # DeepSpeed's op name
    kind: str  # zeromem's ledger kind (all_reduce_norm, ...)
    nbytes: int  # message size
    seconds: float
    caller: str = ""


def bandwidths(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in Gbps, as DeepSpeed's calc_bw_log computes them
    (its all-gather / reduce-scatter sizes are per rank: the whole buffer here is n times that)."""
    seconds = max(seconds, 1e-9)
    n = world
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        tput = nbytes / seconds
        bus = tput * (n - 1) / n
    elif op == "all_reduce":
        tput = nbytes * 2 / seconds
        bus = nbytes / seconds * 2 * (n - 1) / n
    else:  # broadcast
        tput = bus = nbytes / seconds
    return tput * 8 / 1e9, bus * 8 / 1e9


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.2f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return ""


class CommLog:
    """The records of one `Comm`, per the `comms_logger` block."""

    def __init__(self, config, world_size: int, rank: int):
        self.prof_all = config.prof_all
        self.prof_ops = set(config.prof_ops)
        self.verbose = config.verbose
        self.debug = config.debug
        self.world_size = world_size
        self.rank = rank
        self.records: list[Record] = []

    def wanted(self, op: str, kind: str) -> bool:
        return self.prof_all or op in self.prof_ops or kind in self.prof_ops

    def start(self, collective: str, kind: str, nbytes: int) -> tuple | None:
        """A token to pass to `finish` when the collective completes (None: not recorded)."""
        op = DEEPSPEED_OPS[collective]
        if not self.wanted(op, kind):
            return None
        caller = sys._getframe(3).f_code.co_name if self.debug else ""  # who called Comm
        return op, kind, nbytes, time.perf_counter(), caller

    def finish(self, token: tuple | None) -> None:
        if token is None:
            return
        op, kind, nbytes, start, caller = token
        record = Record(op, kind, nbytes, time.perf_counter() - start, caller)
        self.records.append(record)
        if self.verbose:
            alg, bus = bandwidths(op, nbytes, record.seconds, self.world_size)
            where = f" | [Caller Func: {caller}]" if caller else ""
            log.info("rank %d: comm op: %s (%s) | time (ms): %.3f | msg size: %s | algbw (Gbps): "
                     "%.2f | busbw (Gbps): %.2f%s", self.rank, op, kind, record.seconds * 1e3,
                     _size(nbytes), alg, bus, where)

    def table(self) -> dict[str, dict[int, dict[str, float]]]:
        """{op: {message size: count, total_ms, avg_ms, algbw_gbps, busbw_gbps}}."""
        grouped: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in self.records:
            grouped[r.op][r.nbytes].append(r.seconds)
        out: dict[str, dict[int, dict[str, float]]] = {}
        for op, sizes in grouped.items():
            out[op] = {}
            for nbytes, times in sorted(sizes.items()):
                total = sum(times)
                alg, bus = zip(*(bandwidths(op, nbytes, t, self.world_size) for t in times))
                out[op][nbytes] = {"count": len(times), "total_ms": total * 1e3,
                                   "avg_ms": total * 1e3 / len(times),
                                   "algbw_gbps": sum(alg) / len(alg), "busbw_gbps": sum(bus) / len(bus)}
        return out

    def summary(self) -> str:
        """DeepSpeed's log_summary table for this rank."""
        rows = [f"rank {self.rank}: {'Comm. Op':<24}{'Message Size':>14}{'Count':>8}"
                f"{'Total Latency(ms)':>19}{'Avg Latency(ms)':>17}{'tput_avg (Gbps)':>17}"
                f"{'busbw_avg (Gbps)':>18}"]
        for op, sizes in self.table().items():
            for nbytes, row in sizes.items():
                rows.append(f"rank {self.rank}: {op:<24}{_size(nbytes):>14}{row['count']:>8}"
                            f"{row['total_ms']:>19.2f}{row['avg_ms']:>17.3f}"
                            f"{row['algbw_gbps']:>17.2f}{row['busbw_gbps']:>18.2f}")
        return "\n".join(rows)
