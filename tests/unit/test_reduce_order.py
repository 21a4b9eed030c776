"""The launch order of gradient reductions (comm.Comm.schedule_reductions): bucket order on
every rank whatever order buckets become ready in, and the bound on full-size buckets alive.

Pure logic: a Comm over one rank (no process group) schedules the buckets; each launch
returns a `Pending` whose finishing step records that it was waited for; no collective runs.
"""
from __future__ import annotations

from typing import Callable

import pytest

from zeromem.comm import Comm, Pending

COMM = object()  # what the order hands to each launch (a Reduction in the engine)


def scheduled(reduction: object, count: int, max_buckets: int) -> Comm:
    """A Comm over one rank whose gradient buckets launch with `reduction`."""
    comm = Comm()
    comm.schedule_reductions(reduction, count, max_buckets)
    return comm


def _launch(log: list, index: int) -> Callable[[object], Pending]:
    def run(comm: object) -> Pending:
        assert comm is COMM
        log.append(("launch", index))
        return Pending(None, lambda: log.append(("done", index)))
    return run


def test_buckets_launch_in_index_order_whatever_order_they_are_ready_in():
    log: list = []
    order = scheduled(COMM, 3, max_buckets=4)
    order.start_reductions(reducing=True)
    order.reduce_in_order(2, _launch(log, 2))
    order.reduce_in_order(1, _launch(log, 1))
    assert log == [] and not order.launched(1)  # bucket 0 first, on every rank
    order.reduce_in_order(0, _launch(log, 0))
    assert [e for e in log if e[0] == "launch"] == [("launch", 0), ("launch", 1), ("launch", 2)]
    assert all(order.launched(i) for i in range(3))
    order.finish_reductions()
    assert sorted(e for e in log if e[0] == "done") == [("done", 0), ("done", 1), ("done", 2)]


def test_at_most_max_buckets_are_alive_filling_or_reducing():
    log: list = []
    order = scheduled(COMM, 3, max_buckets=2)
    order.start_reductions(reducing=True)
    for i in range(3):
        order.bucket_starts()
        log.append(("fill", i))
        order.reduce_in_order(i, _launch(log, i))
    order.finish_reductions()
    # two alive: bucket i+1 fills while bucket i reduces; a launch waits for the older one
    assert log == [("fill", 0), ("launch", 0), ("fill", 1), ("done", 0), ("launch", 1),
                   ("fill", 2), ("done", 1), ("launch", 2), ("done", 2)]
    assert order.buckets_alive_peak == 2


def test_one_bucket_at_a_time_waits_for_the_reduction_before_the_next_fills():
    log: list = []
    order = scheduled(COMM, 2, max_buckets=1)
    assert order.one_bucket_at_a_time
    order.start_reductions(reducing=True)
    for i in range(2):
        order.bucket_starts()
        log.append(("fill", i))
        order.reduce_in_order(i, _launch(log, i))
    order.finish_reductions()
    assert log == [("fill", 0), ("launch", 0), ("done", 0), ("fill", 1), ("launch", 1),
                   ("done", 1)]
    assert order.buckets_alive_peak == 1


def test_an_accumulating_backward_launches_nothing():
    log: list = []
    order = scheduled(COMM, 2, max_buckets=2)
    order.start_reductions(reducing=False)  # stage 0/1 between boundaries: buckets accumulate
    order.reduce_in_order(0, _launch(log, 0))
    order.finish_reductions()
    assert log == [] and not order.launched(0)


def test_a_bucket_never_handed_in_is_an_error():
    log: list = []
    order = scheduled(COMM, 2, max_buckets=2)
    order.start_reductions(reducing=True)
    order.reduce_in_order(0, _launch(log, 0))
    with pytest.raises(RuntimeError, match="bucket 1 of 2 was never handed in"):
        order.finish_reductions()
    assert ("done", 0) in log  # what was launched is still waited for
