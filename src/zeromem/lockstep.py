"""Ranks in step: a collective call made on some ranks only is refused at once, by name.

`save_checkpoint`, `load_checkpoint`, `save_16bit_model`, `full_state_dict` and (over a
live engine's parameters) `GatheredParameters` are collectives, so every rank must call
them at the same point of the loop. Called under `if rank == 0:`, rank 0's first
collective meets the other ranks' next gradient reduction: both wait for the collective
timeout (10 minutes by default) and then say only that a collective timed out.

So the ranks of one engine keep a common log of what each of them does, in the store:
event n of every rank (a backward, a stage-3 forward that gathers, or one of those
calls) must be the same. The first rank at event n writes it; each later one compares
(one `compare_set`, a round trip to the store, per event). A rank that finds another
event there stops at once, naming both, before it starts a collective its peers will
never join.

Each event also carries the stage-3 gathers this rank launched since its last one, in
order (a count and a checksum: `LiveStats.take_order`): ranks whose all-gathers paired up
different parameters (experts picked by each rank's own data) are stopped at their next
event, before a step applies what those gathers computed.

The log is a ring of `RING` keys: a rank more than `RING` events ahead of another (which
accumulation without collectives could allow) leaves that one unable to compare, never
wrongly refused.
"""
from __future__ import annotations

import contextlib
import secrets
from typing import Callable, Iterator

import torch.distributed as dist

from zeromem.comm import Comm

RING = 4096  # store keys per engine; far more events than ranks ever drift apart

COLLECTIVE_CALLS = ("save_checkpoint, load_checkpoint, save_16bit_model, full_state_dict and "
                    "GatheredParameters")
CALL = "the collective call"
ADVICE = {True: f"{COLLECTIVE_CALLS} are collectives: call them on every rank at the same "
                "point (not under `if rank == 0:`; rank 0 alone writes the files)",
          False: "every rank must run the same backwards and, at stage 3, the same forwards "
                 "(a forward gathers parameters from every rank): evaluate on every rank, not "
                 "under `if rank == 0:`, and pass HF's `generate` synced_gpus=True (ranks "
                 "that stop at different lengths run different numbers of forwards)"}


GATHER_ADVICE = ("every rank must gather the same parameters in the same order, as each "
                 "all-gather pairs with the peers' call at the same position (the parameters "
                 "it filled hold other parameters' values): a module that runs some of its "
                 "submodules as its data decides (a sparse MoE block's experts) must be "
                 "gathered whole: make it a leaf module (zero_optimization.leaf_module, or "
                 "deepspeed.utils.set_z3_leaf_modules)")


class RankDivergenceError(RuntimeError):
    """Ranks of one engine did different things at the same point: one of them made a
    collective call the others did not."""


class Lockstep:
    """This rank's side of the common event log of one engine's ranks."""

    def __init__(self, store: dist.Store | None, key: str, rank: int, ring: int = RING):
        self._store = store  # None: one rank, nothing to compare
        self._key = key
        self._rank = rank
        self._events = 0
        self._seen = [""] * ring  # what each slot held after this rank's last event there
        self._depth = 0  # collective calls entered: one inside another is not an event
        self._gathers: Callable[[], str] = str  # the stage-3 gathers since the last event

    @classmethod
    def agree(cls, comm: Comm) -> Lockstep:
        """The log of a new engine over `comm`'s ranks, keyed by a token its first rank
        draws (each engine has its own: DeepSpeed-Chat runs four side by side)."""
        if comm.world_size == 1 or comm.store is None:
            return cls(None, "", comm.rank)
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, group=comm.group, group_src=0)
        return cls(comm.store, f"zeromem/lockstep/{token[0]}", comm.global_rank)

    def watch(self, gathers: Callable[[], str]) -> None:
        """Each event from now on carries `gathers()`: the stage-3 gathers launched since
        the last one (`LiveStats.take_order`)."""
        self._gathers = gathers

    def pass_starts(self, what: str) -> None:
        """A pass whose collectives every rank runs starts: a backward (its reductions), or
        a stage-3 forward that gathers. `what` says which."""
        if self._depth == 0:
            self._event(what)

    def call(self, call: str, where: str = "") -> None:
        """A collective call every rank must make (`call`, at `where`) starts; one made
        inside another (the checkpoint gathering parameters) is part of it."""
        if self._depth == 0:
            self._event(f"{CALL} {call} {where}".rstrip())

    @contextlib.contextmanager
    def collective(self, call: str, where: str) -> Iterator[None]:
        """Around a collective call every rank must make (`call`, at `where`)."""
        self.call(call, where)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _event(self, what: str) -> None:
        n, self._events = self._events, self._events + 1
        gathered = self._gathers()
        if self._store is None:
            return
        slot, key = n % len(self._seen), f"{self._key}/{n % len(self._seen)}"
        mine, seen = f"{n}|{self._rank}|{gathered}|{what}", self._seen[slot]
        if seen and int(seen.split("|", 1)[0]) >= n:  # a rank this far ahead lapped the ring:
            found = self._store.get(key).decode()     # read it, never write over its event
        else:  # written only if it still holds what it did at this rank's last visit
            found = self._store.compare_set(key, seen, mine).decode()
        self._seen[slot] = found
        index, rank, their_gathers, theirs = found.split("|", 3)
        if int(index) != n:
            return
        if theirs != what:
            raise RankDivergenceError(
                f"ranks diverged at event {n + 1} of this engine: rank {self._rank} runs {what}, "
                f"where rank {rank} ran {theirs}: {ADVICE[CALL in what + theirs]}")
        if their_gathers != gathered:
            raise RankDivergenceError(
                f"ranks diverged before event {n + 1} of this engine ({what}): since the event "
                f"before, rank {self._rank} launched {gathered or 'no gathers'}, where rank "
                f"{rank} launched {their_gathers or 'no gathers'}: {GATHER_ADVICE}")
