"""`calibrate.Clock`: timings net of the CPU time other processes take (planning/calibrate.py).

No speed is asserted. The load is made, not hoped for: this thread and two busy
processes share one core, so the scheduler must keep this thread waiting about two
thirds of the time; the kernel's accounting then says exactly how long. Wall time
less that run-queue delay is the thread's own CPU time (pure compute: it never
sleeps), an identity of the kernel's clocks, not a speed.
"""
from __future__ import annotations

import threading
import time

import pytest

from contention import CAN_SHARE_A_CORE, burn, sharing_one_core
from zeromem.comm import Comm
from zeromem.planning.calibrate import Clock, run_queue_delay

pytestmark = pytest.mark.skipif(not CAN_SHARE_A_CORE,
                                reason="needs Linux's per-thread schedstat and CPU affinity")


def test_run_queue_delay_is_the_time_other_processes_held_the_core():
    clock = Clock(Comm())  # world size 1: no process group
    runs = []
    # a VM's hypervisor may take the core from all of them (steal time), which neither clock
    # counts: the identity below then misses by the steal. Up to 3 tries, the closest kept
    for _ in range(3):
        with sharing_one_core(2):
            cpu = time.thread_time()
            wall, delay = clock.timed(burn, synchronised=False)
            cpu = time.thread_time() - cpu
        runs.append((abs(wall - delay - cpu), wall, delay, cpu))
        if runs[-1][0] <= 0.15 * cpu + 0.01:
            break
    _, wall, delay, cpu = min(runs)
    # two busy processes on the core: this thread runs about a third of the time
    assert delay > 0.25 * wall
    # wall = running + waiting for the core (a busy loop never sleeps)
    assert wall - delay == pytest.approx(cpu, rel=0.15, abs=0.01), runs
    assert run_queue_delay() > 0


def test_seconds_are_the_median_of_wall_less_delay():
    clock = Clock(Comm())
    with sharing_one_core(1):
        seconds = clock.seconds(burn, reps=3, synchronised=False)
    assert seconds == pytest.approx(0.15, rel=0.15, abs=0.01)  # the CPU time burnt


def _burn_in_a_thread(seconds_of_cpu: float) -> None:
    worker = threading.Thread(target=burn, args=(seconds_of_cpu,))
    worker.start()
    worker.join()


def test_worker_cpu_is_the_cpu_time_of_the_processs_other_threads():
    """What gloo's worker threads spend beside the calling one (`Clock.worker_cpu`): a
    thread burning 0.1 s of CPU counts, the calling thread's own compute does not."""
    clock = Clock(Comm())
    assert clock.worker_cpu(lambda: _burn_in_a_thread(0.1), reps=3) == \
        pytest.approx(0.1, rel=0.15, abs=0.01)
    assert clock.worker_cpu(lambda: burn(0.1)) == pytest.approx(0.0, abs=0.01)
