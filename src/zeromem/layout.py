"""Layout arithmetic of flat buffers: padding, shard ranges, owned slices, bucket packing,
and the records it describes (which states a stage shards, where a parameter sits).

Pure functions of integers, shared by the engine (flat.py, engine.py), the
checkpoints, `zeromem.Init` (stage3/partitioned_init.py) and the memory planner (planning/shape_memory.py),
so that what the planner predicts is computed by the same code the engine runs.

A flat buffer of `numel` elements is padded to a multiple of the data-parallel
world size N_d (at least N_d, so that even an empty group has one element per
rank); rank r owns the contiguous shard [r*S, (r+1)*S), S = padded / N_d (ZeRO
paper, section 5). An unsharded buffer (world 1) is one shard: the whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch


def padded_numel(numel: int, world: int) -> int:
    """`numel` rounded up to a multiple of `world` (at least `world`)."""
    return max(1, -(-numel // world)) * world


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank`'s shard of a flat buffer of `numel` elements split over `world` ranks."""

    numel: int
    world: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    @property
    def padded_numel(self) -> int:
        return padded_numel(self.numel, self.world)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world

    @property
    def shard_offset(self) -> int:
        return self.rank * self.shard_numel

    def for_rank(self, rank: int) -> ShardLayout:
        """The same buffer as seen by `rank` (every rank can compute every rank's shard)."""
        return ShardLayout(self.numel, self.world, rank)

    def owned_slice(self, offset: int, numel: int) -> tuple[int, int, int]:
        """(start in the shard, start in the piece, length) of the owned part of
        the piece [offset, offset + numel) of the flat buffer; (0, 0, 0) if none."""
        lo = max(offset, self.shard_offset)
        hi = min(offset + numel, self.shard_offset + self.shard_numel)
        if hi <= lo:
            return (0, 0, 0)
        return (lo - self.shard_offset, lo - offset, hi - lo)


@dataclass(frozen=True)
class Sharding:
    """Which kinds of model state are partitioned over the data-parallel ranks."""

    optimizer: bool
    grads: bool
    params: bool

    @classmethod
    def for_stage(cls, stage: int) -> Sharding:
        return cls(optimizer=stage >= 1, grads=stage >= 2, params=stage >= 3)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its group's flat buffer."""

    name: str
    offset: int
    numel: int
    shape: torch.Size  # the parameter's


def pack_buckets(numels: Iterable[int], bucket_numel: int) -> list[list[int]]:
    """Indices of `numels`, in order, packed greedily into buckets of <= `bucket_numel`.

    An element larger than the bucket gets a bucket of its own; no bucket is empty.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, numel in enumerate(numels):
        if current and size + numel > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += numel
    if current:
        buckets.append(current)
    return buckets


def slices_of(numels: Iterable[int]) -> list[tuple[int, int]]:
    """(offset, numel) of each piece laid end to end in one flat buffer."""
    out, offset = [], 0
    for numel in numels:
        out.append((offset, numel))
        offset += numel
    return out


# ---------------------------------------------------------------- bucket sizes from the model

MIN_BUCKET_NUMEL = 2 ** 20       # below this a gloo/NCCL collective is latency, not bandwidth
MAX_BUCKET_NUMEL = 500_000_000   # DeepSpeed's default: the most one buffer ever holds


def derived_bucket_numel(psi: int, world_size: int) -> int:
    """Default `reduce_bucket_size` and `allgather_bucket_size` for `psi` elements on N_d ranks.

    A quarter of the model (so four or more buckets: reduction overlaps backward, and a
    bucket's buffer stays a fraction of the model), but never under 2^20 x max(1, N_d/2)
    elements (a collective's latency grows with the ring's N_d steps; small models get
    one bucket) and never over DeepSpeed's 5e8.
    """
    floor = MIN_BUCKET_NUMEL * max(1, world_size // 2)
    return min(MAX_BUCKET_NUMEL, max(floor, psi // 4))


def derived_prefetch_numel(largest_unit_numel: int) -> int:
    """Default `stage3_prefetch_bucket_size`: two of the largest fetch units ahead, so the
    next gather is in flight while a unit computes, without gathering the whole model."""
    return 2 * largest_unit_numel


# ---------------------------------------------------------------- communication buffers in flight

REDUCE_IN_FLIGHT = 2  # gradient buckets reducing at once under overlap_comm (comm.Comm.schedule_reductions)
# full-size gradient buckets alive at once by default: REDUCE_IN_FLIGHT reducing (one finishing
# while the next overlaps backward) and one filling (comm.Comm.max_buckets)
BUCKETS_ALIVE = REDUCE_IN_FLIGHT + 1
GATHER_IN_FLIGHT = 2  # updated-shard all-gathers left in flight after each issue (zero_optimizer.py)


def gather_chunks(padded: int, world: int, bucket_numel: int) -> list[tuple[int, int]]:
    """(start, end) in the shard of each all-gather that brings a flat group's updated
    shards back (stages 1-2). A group of at most `bucket_numel` elements is gathered in
    place, into the flat parameter itself: no chunks, no buffer. A larger one in chunks of
    `bucket_numel // world` shard elements, each into a buffer of world x chunk elements,
    so that no single collective exceeds the bucket (constant buffers)."""
    if world == 1 or padded <= bucket_numel:
        return []
    shard, chunk = padded // world, max(1, bucket_numel // world)
    return [(start, min(start + chunk, shard)) for start in range(0, shard, chunk)]


def peak_in_flight(sizes: list[int], alive: int) -> int:
    """The most of `sizes` (buffers issued in this order, the oldest finished and freed
    whenever `alive` are out) that are alive at once: the largest sum of `alive`
    consecutive sizes."""
    if not sizes:
        return 0
    return max(sum(sizes[i:i + alive]) for i in range(max(1, len(sizes) - alive + 1)))
