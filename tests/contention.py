"""Load made on purpose: this thread and busy processes sharing one core.

For tests of timings net of load (`calibrate.Clock`): the scheduler must then keep
the thread waiting, and the kernel's accounting says for how long.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

CAN_SHARE_A_CORE = (hasattr(os, "sched_setaffinity") and
                    os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"))

BUSY = "import os; os.sched_setaffinity(0, {%d}); print(flush=True)\nwhile True: pass"


@contextmanager
def sharing_one_core(competitors: int, index: int = 0):
    """This thread and `competitors` busy processes, all pinned to one core (the
    `index`-th this process may use, modulo their number)."""
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    cpu = cores[index % len(cores)]
    procs = [subprocess.Popen([sys.executable, "-c", BUSY % cpu], stdout=subprocess.PIPE)
             for _ in range(competitors)]
    try:
        for p in procs:
            p.stdout.readline()  # pinned and spinning
        os.sched_setaffinity(0, {cpu})
        yield
    finally:
        os.sched_setaffinity(0, before)
        for p in procs:
            p.kill()
            p.wait()


def burn(seconds_of_cpu: float = 0.15) -> None:
    """Busy for `seconds_of_cpu` of this thread's CPU time (it never sleeps)."""
    end = time.thread_time() + seconds_of_cpu
    while time.thread_time() < end:
        pass
