"""Training checkpoints' pure logic: pieces and coverage, each rank's pieces of a flat group,
streamed safetensors, the JSON codec, and the Stateful pieces (no process group)."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zeromem.checkpoints.consolidate import (CHUNK_BYTES, Piece, SafetensorsReader, TensorSpec,
                                             check_coverage, decode, encode, overlaps,
                                             write_safetensors)
from zeromem.checkpoints.save_load import CheckpointError, group_pieces
from zeromem.flat import FlatParamGroup, Sharding


def test_overlaps_and_coverage():
    pieces = [Piece("w", 0, 4, "a"), Piece("w", 4, 3, "b"), Piece("w", 7, 5, "c")]
    check_coverage("w", pieces, 12)
    got = [(p.file, src, dst, n) for p, src, dst, n in overlaps(pieces, 3, 6)]
    assert got == [("a", 3, 0, 1), ("b", 0, 1, 3), ("c", 0, 4, 2)]
    with pytest.raises(CheckpointError, match=r"no piece for elements \[4, 5\)"):
        check_coverage("w", [pieces[0], Piece("w", 5, 7, "c")], 12)
    with pytest.raises(CheckpointError, match="has 13 elements but its pieces cover 12"):
        check_coverage("w", pieces, 13)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("sharded", [False, True])
def test_group_pieces_tile_every_parameter(world_size, sharded):
    shapes = [(3, 5), (7,), (2, 2, 2)]
    covered = {i: [] for i in range(len(shapes))}
    for rank in range(world_size):
        comm = SimpleNamespace(rank=rank, world_size=world_size)
        params = [nn.Parameter(torch.randn(s)) for s in shapes]
        group = FlatParamGroup(params, [str(i) for i in range(len(shapes))], comm,
                               Sharding(optimizer=sharded, grads=False, params=False), 0)
        for slot, s0, p0, n in group_pieces(group, rank):
            assert group.owned_slice(slot) == (s0, p0, n)  # what this rank really owns
            covered[int(slot.name)].append(Piece(slot.name, p0, n))
    for i, shape in enumerate(shapes):
        pieces = sorted(covered[i], key=lambda p: p.offset)
        check_coverage(str(i), pieces, torch.Size(shape).numel())


def test_streamed_safetensors_are_standard_and_read_by_range(tmp_path):
    from safetensors.torch import load_file
    big = torch.arange(CHUNK_BYTES // 4 + 10, dtype=torch.float32)
    tensors = {"a": torch.randn(3, 4), "b": torch.tensor([1, 2, 3]), "c": big,
               "d": torch.randn(5).to(torch.bfloat16), "e": torch.zeros(0)}
    specs = [TensorSpec.of(k, v) for k, v in tensors.items()]
    specs[2] = TensorSpec("c", torch.float32, tuple(big.shape), lambda: [big[:7], big[7:]])
    write_safetensors(tmp_path / "x.safetensors", specs, {"k": "v"})
    loaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with SafetensorsReader(tmp_path / "x.safetensors") as reader:
        assert reader.metadata["k"] == "v"
        assert torch.equal(reader.read("a", 5, 4), tensors["a"].flatten()[5:9])
        chunks = [c.clone() for c in reader.read_chunks("c", 3, big.numel() - 3)]  # reused buffer
        assert len(chunks) == 2 and torch.equal(torch.cat(chunks), big[3:])
        with pytest.raises(CheckpointError, match="outside tensor 'b'"):
            reader.read("b", 2, 2)
        with pytest.raises(CheckpointError, match="no tensor 'zz'"):
            reader.read("zz")


def test_json_codec_round_trip():
    state = {"step": torch.tensor(3.0), "betas": (0.9, 0.999), "n": None,
             "lrs": [1e-3, float("inf")], 1: "int key"}
    back = decode(json.loads(json.dumps(encode(state, "state"))))
    assert back["betas"] == (0.9, 0.999) and back[1] == "int key" and back["lrs"][1] == float("inf")
    assert torch.equal(back["step"], state["step"]) and back["step"].dtype == torch.float32
    with pytest.raises(CheckpointError, match="cannot store state.fn: a function"):
        encode({"fn": lambda: 0}, "state")


def test_checkpointed_pieces_are_stateful_and_round_trip():
    """Scaler, scheduler, counters and RNG each offer state_dict / load_state_dict."""
    from zeromem.precision import DynamicScaler, NoScaler, StaticScaler
    from zeromem.optim.schedulers import WarmupLR
    from zeromem.training_state import RngState, Stateful, StepCounters

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for thing in (NoScaler(), StaticScaler(8.0), DynamicScaler(), WarmupLR(optimizer, 0.0, 0.1, 5),
                  StepCounters(2), RngState()):
        assert isinstance(thing, Stateful), type(thing).__name__

    counters = StepCounters(gradient_accumulation_steps=2)
    for micro in range(7):
        boundary = counters.at_boundary()
        counters.advance_micro()
        if boundary:
            counters.advance_global(skipped=micro == 1)
    assert (counters.global_steps, counters.micro_steps, counters.skipped_steps) == (3, 7, 1)
    assert counters.mid_accumulation()
    same, other = StepCounters(2), StepCounters(4)
    same.load_state_dict(counters.state_dict())
    other.load_state_dict(counters.state_dict())
    assert same.micro_steps == 7 and other.micro_steps == 3 * 4  # boundaries kept under 4

    # Accelerate's way: a boundary announced before each backward, step() at boundaries only
    announced = StepCounters(gradient_accumulation_steps=3)
    for is_boundary in (False, False, True, False, True):  # a short window last
        announced.announce_boundary(is_boundary)
        assert announced.at_boundary() is is_boundary
        assert announced.mid_accumulation() is not is_boundary  # a save here would warn
        if is_boundary:
            announced.advance_micro()
            announced.advance_global(skipped=False)
    assert (announced.global_steps, announced.micro_steps) == (2, 2)
    assert not announced.mid_accumulation()

    rng = RngState()
    saved = rng.state_dict()
    first = (torch.rand(3), random.random())
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(3), first[0]) and random.random() == first[1]
