"""Layout arithmetic (layout.py): pure, no process group."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zeromem.planning.shape_memory import reduce_buckets
from zeromem.layout import (ShardLayout, gather_chunks, pack_buckets, padded_numel,
                            peak_in_flight, slices_of)


def test_padding_and_shard_ranges_tile_the_buffer():
    for numel in (0, 1, 5, 6, 7, 100):
        for world in (1, 2, 3, 4):
            padded = padded_numel(numel, world)
            assert padded % world == 0 and padded >= numel
            assert padded - numel < world or numel == 0 and padded == world
            covered = []
            for rank in range(world):
                lay = ShardLayout(numel, world, rank)
                assert lay.padded_numel == padded and lay.shard_numel * world == padded
                covered += range(lay.shard_offset, lay.shard_offset + lay.shard_numel)
            assert covered == list(range(padded))


def test_owned_slices_of_pieces_partition_each_piece():
    pieces = slices_of([3, 1, 4, 1, 5])
    assert pieces == [(0, 3), (3, 1), (4, 4), (8, 1), (9, 5)]
    numel = 14
    for world in (1, 2, 3, 5):
        for offset, n in pieces:
            seen = []
            for rank in range(world):
                lay = ShardLayout(numel, world, rank)
                start, at, length = lay.owned_slice(offset, n)
                if length:
                    assert lay.shard_offset + start == offset + at  # same flat element
                    assert start + length <= lay.shard_numel
                seen += range(at, at + length)
            assert sorted(seen) == list(range(n))


def test_owned_slice_outside_the_shard_is_empty():
    lay = ShardLayout(8, 2, 1)  # owns [4, 8)
    assert lay.owned_slice(0, 4) == (0, 0, 0)
    assert lay.owned_slice(2, 4) == (0, 2, 2)
    assert lay.for_rank(0).owned_slice(2, 4) == (2, 0, 2)
    with pytest.raises(ValueError):
        ShardLayout(8, 2, 2)


def test_pack_buckets_is_greedy_and_never_empty():
    assert pack_buckets([3, 3, 3], 6) == [[0, 1], [2]]
    assert pack_buckets([10, 1, 1], 4) == [[0], [1, 2]]  # oversize piece: a bucket of its own
    assert pack_buckets([1, 10, 1], 4) == [[0], [1], [2]]
    assert pack_buckets([], 4) == []


def test_planner_buckets_are_the_engines():
    params = [nn.Parameter(torch.zeros(n)) for n in (5, 2, 7, 1, 3)]
    backward = params[::-1]  # the engine packs its buckets in backward's order
    engine_sizes = [sum(backward[i].numel() for i in b)
                    for b in pack_buckets((p.numel() for p in backward), 8)]
    assert reduce_buckets(tuple(p.numel() for p in params), 8) == engine_sizes == [4, 7, 7]


def test_gather_chunks_cover_the_shard_within_the_bucket():
    assert gather_chunks(100, 2, 100) == [] and gather_chunks(100, 1, 10) == []  # in place
    chunks = gather_chunks(100, 2, 30)  # shard 50, chunks of 15 shard elements
    assert chunks == [(0, 15), (15, 30), (30, 45), (45, 50)]
    assert gather_chunks(8, 4, 2) == [(0, 1), (1, 2)]  # never an empty chunk


def test_peak_in_flight_is_the_largest_window_of_consecutive_buffers():
    assert peak_in_flight([], 2) == 0
    assert peak_in_flight([5], 3) == 5
    assert peak_in_flight([1, 4, 2, 3], 1) == 4
    assert peak_in_flight([1, 4, 2, 3], 2) == 6  # 4 + 2: launched in order
    assert peak_in_flight([3, 0, 0, 3], 3) == 3  # in-place gathers hold a slot, no bytes
