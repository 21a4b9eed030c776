"""The harness's ranks: the caller's environment at the call reaches them, and a
setting the C library reads only at process start gets freshly spawned ranks."""
from __future__ import annotations

import os

from harness import run_distributed


def _seen(rank: int, world_size: int) -> tuple[int, str | None]:
    return os.getppid(), os.environ.get("ZEROMEM_HARNESS_PROBE")


def test_ranks_see_the_callers_environment_and_start_fresh_when_it_must(monkeypatch):
    monkeypatch.setenv("ZEROMEM_HARNESS_PROBE", "set after the server started")
    run_distributed(_seen, 1)  # the forkserver now runs, with an older environment
    monkeypatch.setenv("ZEROMEM_HARNESS_PROBE", "set later")
    forked = run_distributed(_seen, 2)
    assert [value for _, value in forked] == ["set later"] * 2
    assert all(parent != os.getpid() for parent, _ in forked)  # children of the server
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    spawned = run_distributed(_seen, 2)
    assert spawned == [(os.getpid(), "set later")] * 2  # this process's own children
