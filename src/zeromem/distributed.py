"""The process group's life: creating it from torchrun's environment, and ending it cleanly.

Timeouts come from the config's `zeromem` block (`timeout_s`, `gather_timeout_s`);
the environment variables ZEROMEM_TIMEOUT_S / ZEROMEM_GATHER_TIMEOUT_S, when set,
override it. Precedence: environment, then config, then the defaults (600 s / 300 s).

Restarts. torchrun's agent keeps one TCPStore for the whole job and hands it to
every restart round (TORCHELASTIC_USE_AGENT_STORE), and gloo publishes each rank's
address under fixed keys. A restarted rank could read the address of the peer that
died, so the group never formed. `ensure_process_group` therefore opens the store
itself and keys each round apart (`zeromem/restart<N>/...`).

Shutdown. A gloo worker thread that frees a finished collective's tensors during
interpreter shutdown needs the GIL and C++ terminates the process (SIGABRT), so a
finished job looks failed to torchrun. `Lifecycle.shutdown` therefore runs while
Python is still whole (at exit, on SIGTERM, or when called): it closes every live
engine (each waits for and drops its collectives in flight, removes swap files),
meets the other ranks, and destroys the default group if zeromem created it.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from datetime import timedelta

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zeromem.comm import Comm

log = logging.getLogger("zeromem")

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_GATHER_TIMEOUT_S = 300.0
STORE_ATTEMPTS = 3  # connecting to the store can be refused or reset on a loaded host


def collective_timeout_s(config_value: float | None = None) -> float:
    """Seconds a collective waits for a rank that died or diverged: env, config, default."""
    env = os.environ.get("ZEROMEM_TIMEOUT_S")
    if env:
        return float(env)
    return float(config_value) if config_value is not None else DEFAULT_TIMEOUT_S


def gather_timeout_s(config_value: float | None = None) -> float | None:
    """Seconds a stage-3 gather may wait before the ranks count as diverged (None = no limit).

    A rank that runs a forward the others do not (evaluation on rank 0 only) then
    fails with a message naming the module and the ranks that did not follow.
    Env ZEROMEM_GATHER_TIMEOUT_S, then config `zeromem.gather_timeout_s`, then 300.
    """
    env = os.environ.get("ZEROMEM_GATHER_TIMEOUT_S")
    value = float(env) if env else (DEFAULT_GATHER_TIMEOUT_S if config_value is None
                                    else float(config_value))
    return value if value > 0 else None


def local_device(backend: str) -> torch.device:
    """The device of this rank: CUDA device LOCAL_RANK (never the global rank) under NCCL.

    torchrun sets LOCAL_RANK per node; with a group created by the user and no
    LOCAL_RANK, the device they selected.
    """
    if backend != "nccl":
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def ranks_per_node_from_env() -> int | None:
    """ZEROMEM_RANKS_PER_NODE (tests run 4 ranks as 2 "nodes" of 2), else torchrun's
    LOCAL_WORLD_SIZE; None when neither is set."""
    value = os.environ.get("ZEROMEM_RANKS_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


@dataclass(frozen=True)
class Runtime:
    """What the process environment decides for one engine, read once at the edge.

    `zeromem.initialize` reads it (`from_env`) and passes it down, so nothing inside
    the engine reads an environment variable or the default process group.
    """

    device: torch.device  # LOCAL_RANK's GPU under NCCL (never the global rank's), else the CPU
    global_rank: int  # names swap files: unique across nodes and data-parallel groups
    gather_timeout_s: float | None  # a stage-3 gather waiting longer is a divergence
    # the environment's ranks per node (None: unset); the config's cluster.ranks_per_node wins
    ranks_per_node: int | None = None

    @classmethod
    def from_env(cls, group: dist.ProcessGroup | None,
                 gather_timeout_config_s: float | None) -> Runtime:
        """From torchrun's variables, the default group and ZEROMEM_GATHER_TIMEOUT_S, for an
        engine over `group` (its backend picks the device)."""
        backend = dist.get_backend(group) if dist.is_initialized() else "none"
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(local_device(backend), rank, gather_timeout_s(gather_timeout_config_s),
                   ranks_per_node_from_env())


def ensure_process_group(timeout_s: float | None = None, backend: str | None = None) -> bool:
    """Initialise the default group (`backend`; by default NCCL with CUDA, else gloo) if
    torchrun launched us.

    Returns True when this call created it. Without torchrun's variables and without
    a group, nothing is created: zeromem then runs as world size 1. The group itself
    is formed once: a rank that retried alone would pair with peers still waiting in
    its first attempt. If it fails, the worker fails and `torchrun --max-restarts`
    starts a fresh round for every rank (with fresh keys, see `round_store`).
    """
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    timeout = timedelta(seconds=collective_timeout_s(timeout_s))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = round_store(rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    LIFECYCLE.created_group()
    return True


def round_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The launcher's store (MASTER_ADDR:MASTER_PORT), keyed apart for this restart round.

    `dist.rendezvous("env://")` connects as torch itself would: a client of
    torchrun's agent store when TORCHELASTIC_USE_AGENT_STORE is set, else rank 0
    hosts the store. A refused or reset connection is retried a few times.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for attempt in range(1, STORE_ATTEMPTS + 1):
        try:
            store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
            break
        except (RuntimeError, ValueError) as error:  # DistStoreError / DistNetworkError
            if attempt == STORE_ATTEMPTS:
                raise
            log.warning("store at %s:%s not reached (attempt %d of %d): %s; retrying",
                        os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"),
                        attempt, STORE_ATTEMPTS, error)
            time.sleep(attempt)
    return dist.PrefixStore(f"zeromem/restart{restart}", store)  # keys: zeromem/restart<N>/<key>


def default_store():
    """The default process group's key-value store, or None (used only for diagnostics)."""
    if not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except (ImportError, RuntimeError):
        return None


class LiveEngine(Protocol):
    """What `Lifecycle` knows of an engine: its `Comm` (the comms log reads it) and `close`."""

    comm: Comm

    def close(self, barrier_timeout_s: float = ...) -> None: ...


class Lifecycle:
    """The engines alive in this process, and whether zeromem created the default group.

    One per process (held by this module as LIFECYCLE) because what it answers to
    is per process: interpreter exit and signals.
    """

    def __init__(self) -> None:
        self._engines: list[weakref.ref[LiveEngine]] = []  # in the order built: newest last
        self.owns_group = False
        self.failed = False  # an uncaught exception is ending the process
        self._installed = False

    def register(self, engine: LiveEngine) -> None:
        """Close `engine` at shutdown (also at exit and on SIGTERM, whoever created the
        group) unless it was closed before."""
        self._engines = [ref for ref in self._engines if ref() is not None] + [weakref.ref(engine)]
        self.install_handlers()

    @property
    def engines(self) -> list[LiveEngine]:
        """The engines still referenced, oldest first."""
        return [engine for engine in (ref() for ref in self._engines) if engine is not None]

    def created_group(self) -> None:
        """zeromem created the default group: end it at exit (a gloo group left alive at
        interpreter exit now and then aborts the process, pytorch#179291)."""
        self.owns_group = True
        self.install_handlers()

    def install_handlers(self) -> None:
        """At exit and on SIGTERM (torchrun's stop signal), shut down cleanly."""
        if self._installed:
            return
        self._installed = True
        atexit.register(self._at_exit)
        previous_hook = sys.excepthook

        def note_failure(*exc_info) -> None:  # an uncaught error: peers may never reach a barrier
            self.failed = True
            previous_hook(*exc_info)

        sys.excepthook = note_failure
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a user's handler wins
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def shutdown(self, barrier_timeout_s: float = 10.0, destroy_group: bool = True) -> None:
        """Close live engines, meet the other ranks, destroy the group zeromem created.

        The barrier is bounded: a rank leaving after an error must not wait for
        peers that will never arrive. `barrier_timeout_s` 0 skips it.
        """
        for engine in self.engines:
            engine.close(barrier_timeout_s=0)  # one barrier below, over every rank
        self._engines = []
        if barrier_timeout_s > 0 and dist.is_initialized() and dist.get_world_size() > 1:
            try:  # no rank leaves while another still runs a collective with it
                dist.barrier(async_op=True).wait(timedelta(seconds=barrier_timeout_s))
            except RuntimeError:
                log.warning("shutdown: not every rank reached the exit barrier in %gs",
                            barrier_timeout_s)
        gc.collect()  # finished Works and their tensors are freed here, holding the GIL
        if destroy_group and self.owns_group and dist.is_initialized():
            self.owns_group = False
            dist.destroy_process_group()

    def _at_exit(self) -> None:
        """Interpreter exit: meet the other ranks unless this one dies of an uncaught error,
        then end the default group even if the script created it: a gloo group alive when
        the interpreter finalizes now and then aborts the finished process (SIGABRT,
        "terminate called without an active exception", pytorch#179291)."""
        self.shutdown(barrier_timeout_s=0 if self.failed else 10.0)
        if dist.is_initialized() and not self.failed:
            dist.destroy_process_group()

    def _on_sigterm(self, signum: int, frame) -> None:
        """Close engines (swap files removed) without waiting for peers, then die of SIGTERM."""
        try:
            self.shutdown(barrier_timeout_s=0, destroy_group=False)  # peers may be gone
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


LIFECYCLE = Lifecycle()


def shutdown(barrier_timeout_s: float = 10.0) -> None:
    """Close every live engine and end the group zeromem created (also run at exit)."""
    LIFECYCLE.shutdown(barrier_timeout_s)
