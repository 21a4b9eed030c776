"""Spawn a world of gloo ranks on this machine and run one function in each.

Ranks are forked from a server that imported torch and zeromem once (a fresh
interpreter spends about 4 s importing them; a fork, a tenth of that). Each rank gets
the caller's environment as it is at the call. What the C library reads only as a
process starts (MALLOC_* tunables) cannot reach a fork, so a caller that sets one gets
freshly spawned ranks. Starting costs time either way: a test should run many cases
inside one world. Exceptions in any rank are carried back to the parent with their
traceback; a rank that hangs is killed after `timeout_s` and reported.
"""
from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Read by the C library as a process starts: a forked rank keeps the server's, which are
# this process's own (the server starts from them: only a world that keeps them forks).
_READ_AT_START = ("MALLOC_", "LD_")
_PRELOADED = ["torch", "torch._dynamo", "torch.distributed", "zeromem"]


def _read_at_start() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_READ_AT_START)}


_OWN_AT_START = _read_at_start()


def _context() -> Any:
    """The start method for a world: forked from the preloaded server unless the caller
    changed something a fork cannot take on (a test that sets MALLOC_*)."""
    if _read_at_start() != _OWN_AT_START:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOADED)  # read once, when the server first starts
    return ctx


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue,
            backend: str, environ: dict[str, str]) -> None:
    os.environ.clear()  # a forked rank starts with the server's; a test may have set its own
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    import zeromem
    finished = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
        finished = True
    except BaseException:  # carried back to the parent, which re-raises
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # Engines' collectives finished and dropped, ranks met (not after an error: the
        # others may never come), and only then the group goes: a clean exit, never SIGABRT.
        zeromem.shutdown(barrier_timeout_s=10 if finished else 0)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300,
                    backend: str = "gloo") -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks (gloo; nccl: one GPU each).

    Returns the per-rank return values (picklable), ordered by rank.
    """
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend, environ),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < world_size:
        if queue.empty():
            if time.monotonic() > deadline:
                break
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
    killed = set()
    for r, p in enumerate(procs):
        p.join(timeout=15)
        if p.is_alive():
            p.kill()
            killed.add(r)
    for r, p in enumerate(procs):
        if r in killed or p.exitcode in (0, None) or any(e.startswith(f"rank {r} ") for e in errors):
            continue
        # a rank that finished its work and then died at exit (e.g. SIGABRT) is a failure too
        when = "after finishing" if r in results else "before finishing"
        errors.append(f"rank {r} died with exit code {p.exitcode} {when}")
    if errors:
        raise AssertionError("\n".join(errors))
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise TimeoutError(f"ranks {missing} did not finish within {timeout_s}s")
    return [results[r] for r in range(world_size)]


def _each_call(rank: int, world_size: int, calls: dict) -> dict:
    return {name: fn(rank, world_size, *args) for name, (fn, args) in calls.items()}


def run_together(calls: dict[str, tuple[Callable, tuple]], world_size: int,
                 timeout_s: float = 300) -> dict[str, list]:
    """Run several `fn(rank, world_size, *args)` one after another in ONE spawned world.

    Spawning a world costs more than most cases, so a test file runs its cases this way
    from a module-scoped fixture. Returns, per call name, the per-rank results.
    """
    per_rank = run_distributed(_each_call, world_size, calls, timeout_s=timeout_s)
    return {name: [results[name] for results in per_rank] for name in calls}
