"""Which node each rank runs on, and the process groups that follow the nodes.

torchrun numbers ranks node by node: global rank = node * ranks_per_node + local
rank (its `GROUP_RANK`, `LOCAL_RANK` and `LOCAL_WORLD_SIZE` variables). `NodeLayout`
is that arithmetic, pure and testable without a process group. The number of ranks
per node is given (`NodeLayout.of`): the config's `zeromem.cluster.ranks_per_node`, else
what `distributed.Runtime` read from the environment (ZEROMEM_RANKS_PER_NODE, torchrun's
LOCAL_WORLD_SIZE), else the whole world. Nothing here reads the environment.

`Mesh` builds the groups the two-level collectives need (ZeRO++, arXiv 2306.10209,
sections 3.2-3.3; MiCS; FSDP's HSDP): blocks of consecutive ranks (`blocks`, the
shard group of hybrid sharding or hpZ's secondary group) and, across blocks, the
ranks at the same position in each block (`across`, the replica group). Every rank
creates every group, in the same order, as `torch.distributed.new_group` requires.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class NodeLayout:
    """`world_size` ranks on nodes of `ranks_per_node` consecutive ranks."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks per node {self.ranks_per_node} does not divide the world "
                             f"size {self.world_size}")

    @classmethod
    def of(cls, world_size: int, *ranks_per_node: int | None) -> NodeLayout:
        """The first of `ranks_per_node` that is set (capped at the world), else one node."""
        value = next((n for n in ranks_per_node if n), world_size)
        return cls(world_size, min(int(value), world_size))

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def off_node_fraction(self, ranks: list[int], me: int) -> float:
        """Of `me`'s peers in a group of `ranks`, the fraction on other nodes.

        The ledger's model of a collective: each rank sends an equal share to every peer
        (all-to-all, direct all-gather), so this fraction of its bytes crosses nodes.
        """
        peers = [r for r in ranks if r != me]
        if not peers:
            return 0.0
        return sum(self.node_of(r) != self.node_of(me) for r in peers) / len(peers)


def block_ranks(world_size: int, block: int) -> list[list[int]]:
    """Consecutive blocks of `block` ranks: [[0..block-1], [block..2*block-1], ...]."""
    if block < 1 or world_size % block:
        raise ValueError(f"group size {block} does not divide the world size {world_size}")
    return [list(range(start, start + block)) for start in range(0, world_size, block)]


def across_ranks(world_size: int, block: int) -> list[list[int]]:
    """The ranks at the same position of each block: [[0, block, 2*block..], [1, ...], ...]."""
    return [list(range(pos, world_size, block)) for pos in range(block)]


class Mesh:
    """This rank's node and the groups of blocks of `block` ranks and across them.

    `block` is usually the node (hpZ, hierarchical reduce-scatter) or MiCS's shard
    size. Groups are created over the default group: call on every rank; `rank` is this
    process's rank in it (`Comm.global_rank`).
    """

    def __init__(self, layout: NodeLayout, block: int, rank: int):
        self.layout = layout
        self.block = block
        self.rank = rank
        self.block_group, self.block_members = self._my_group(block_ranks(layout.world_size, block))
        self.across_group, self.across_members = self._my_group(
            across_ranks(layout.world_size, block))

    def _my_group(self, partition: list[list[int]]) -> tuple[dist.ProcessGroup | None, list[int]]:
        mine, members = None, [self.rank]
        for ranks in partition:  # every rank creates every group, in the same order
            group = dist.new_group(ranks) if dist.is_initialized() and len(ranks) > 1 else None
            if self.rank in ranks:
                mine, members = group, ranks
        return mine, members
