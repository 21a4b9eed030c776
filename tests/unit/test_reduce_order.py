"""The launch order of gradient reductions (comm.ReduceOrder): bucket order on every rank
whatever order buckets become ready in, and the bound on full-size buckets alive.

Pure logic: each launch returns a `Pending` whose finishing step records that it was waited
for; no collective runs.
"""
from __future__ import annotations

from typing import Callable

import pytest

from zeromem.comm import Pending, ReduceOrder

COMM = object()  # what the order hands to each launch (a Reduction in the engine)


def _launch(log: list, index: int) -> Callable[[object], Pending]:
    def run(comm: object) -> Pending:
        assert comm is COMM
        log.append(("launch", index))
        return Pending(None, lambda: log.append(("done", index)))
    return run


def test_buckets_launch_in_index_order_whatever_order_they_are_ready_in():
    log: list = []
    order = ReduceOrder(COMM, 3, max_buckets=4)  # type: ignore[arg-type]
    order.start(reducing=True)
    order.ready(2, _launch(log, 2))
    order.ready(1, _launch(log, 1))
    assert log == [] and not order.launched(1)  # bucket 0 first, on every rank
    order.ready(0, _launch(log, 0))
    assert [e for e in log if e[0] == "launch"] == [("launch", 0), ("launch", 1), ("launch", 2)]
    assert all(order.launched(i) for i in range(3))
    order.finish()
    assert sorted(e for e in log if e[0] == "done") == [("done", 0), ("done", 1), ("done", 2)]


def test_at_most_max_buckets_are_alive_filling_or_reducing():
    log: list = []
    order = ReduceOrder(COMM, 3, max_buckets=2)  # type: ignore[arg-type]
    order.start(reducing=True)
    for i in range(3):
        order.bucket_starts()
        log.append(("fill", i))
        order.ready(i, _launch(log, i))
    order.finish()
    # two alive: bucket i+1 fills while bucket i reduces; a launch waits for the older one
    assert log == [("fill", 0), ("launch", 0), ("fill", 1), ("done", 0), ("launch", 1),
                   ("fill", 2), ("done", 1), ("launch", 2), ("done", 2)]
    assert order.buckets_alive_peak == 2


def test_one_bucket_at_a_time_waits_for_the_reduction_before_the_next_fills():
    log: list = []
    order = ReduceOrder(COMM, 2, max_buckets=1)  # type: ignore[arg-type]
    assert order.one_bucket_at_a_time
    order.start(reducing=True)
    for i in range(2):
        order.bucket_starts()
        log.append(("fill", i))
        order.ready(i, _launch(log, i))
    order.finish()
    assert log == [("fill", 0), ("launch", 0), ("done", 0), ("fill", 1), ("launch", 1),
                   ("done", 1)]
    assert order.buckets_alive_peak == 1


def test_an_accumulating_backward_launches_nothing():
    log: list = []
    order = ReduceOrder(COMM, 2, max_buckets=2)  # type: ignore[arg-type]
    order.start(reducing=False)  # stage 0/1 between boundaries: buckets accumulate
    order.ready(0, _launch(log, 0))
    order.finish()
    assert log == [] and not order.launched(0)


def test_a_bucket_never_handed_in_is_an_error():
    log: list = []
    order = ReduceOrder(COMM, 2, max_buckets=2)  # type: ignore[arg-type]
    order.start(reducing=True)
    order.ready(0, _launch(log, 0))
    with pytest.raises(RuntimeError, match="bucket 1 of 2 was never handed in"):
        order.finish()
    assert ("done", 0) in log  # what was launched is still waited for
