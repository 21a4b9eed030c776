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
from zeromem.flat import FlatParamGroup
from zeromem.layout import Sharding


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
    from zeromem.training_state import BatchSizes, RngState, Stateful, StepCounters

    def counting(accumulation: int) -> StepCounters:
        return StepCounters(BatchSizes(micro=4, accumulation=accumulation, ranks=2))

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for thing in (NoScaler(), StaticScaler(8.0), DynamicScaler(), WarmupLR(optimizer, 0.0, 0.1, 5),
                  counting(2), RngState()):
        assert isinstance(thing, Stateful), type(thing).__name__

    counters = counting(2)
    for micro in range(7):
        boundary = counters.at_boundary()
        counters.advance_micro(boundary)
        if boundary:
            counters.advance_global(skipped=micro == 1)
    assert (counters.global_steps, counters.micro_steps, counters.skipped_steps) == (3, 7, 1)
    assert counters.mid_accumulation()
    same, other = counting(2), counting(4)
    same.load_state_dict(counters.state_dict())
    other.load_state_dict(counters.state_dict())
    assert same.micro_steps == 7 and other.micro_steps == 3 * 4  # boundaries kept under 4
    assert same.mid_accumulation() and not other.mid_accumulation()
    assert counters.global_samples == same.global_samples == 3 * 16  # skipped steps count too
    legacy = {k: v for k, v in counters.state_dict().items() if k != "global_samples"}
    same.load_state_dict(legacy)  # a checkpoint from before samples were counted
    assert same.global_samples == 3 * 16

    # Accelerate's way: a boundary announced before each backward, step() at boundaries only
    announced = counting(3)
    for is_boundary in (False, False, True, False, True):  # a short window last
        announced.announce_boundary(is_boundary)
        assert announced.at_boundary() is is_boundary
        assert announced.mid_accumulation() is not is_boundary  # a save here would warn
        announced.advance_backward()
        if is_boundary:
            announced.advance_micro(is_boundary)
            announced.advance_global(skipped=False)
    assert (announced.global_steps, announced.micro_steps) == (2, 2)
    assert not announced.mid_accumulation()
    assert announced.global_samples == 5 * 4 * 2  # the backwards run, not 2 x the batch

    rng = RngState()
    saved = rng.state_dict()
    first = (torch.rand(3), random.random())
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(3), first[0]) and random.random() == first[1]


def test_batch_ramp_up_keeps_each_accumulation_whole():
    """Megatron-DeepSpeed's ramp-up sets the batch before every step. Counting boundaries
    from the last one (not micro_steps % accumulation, as DeepSpeed does) keeps each window
    as long as the batch it was set to: 1, 2, 2, 3, 3 micro-steps here, where DeepSpeed's
    count would end the first window of 3 after one micro-step (micro_steps 5 -> 6)."""
    from zeromem.training_state import BatchSizes, StepCounters

    counters = StepCounters(BatchSizes(micro=2, accumulation=1, ranks=2))
    windows = []
    for train in (4, 8, 8, 12, 12):
        counters.resize(counters.batch.with_train(train))
        run = 1
        while not counters.at_boundary():
            counters.advance_backward()
            counters.advance_micro(False)
            run += 1
        counters.advance_backward()
        counters.advance_micro(True)
        counters.advance_global(skipped=False)
        windows.append(run)
    assert windows == [1, 2, 2, 3, 3]
    assert counters.global_samples == 4 + 8 + 8 + 12 + 12

    counters.advance_micro(False)  # a window begun: its micro-step was scaled by 1/3
    with pytest.raises(ValueError, match="from 3 to 4 in the middle of an accumulation"):
        counters.resize(counters.batch.with_train(16))
    counters.resize(counters.batch.with_micro(1))  # a smaller micro-batch keeps the window
    assert counters.batch.train == 1 * 3 * 2
    with pytest.raises(ValueError, match="train_batch_size -2 is not a positive multiple"):
        counters.batch.with_train(-2)
    with pytest.raises(ValueError, match="train_batch_size 7 is not a positive multiple of "
                                         r"micro-batch 1 x 2 ranks = 2"):
        counters.batch.with_train(7)
