"""zeromem.Init builds models already partitioned; GatheredParameters reads and edits them."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import zeromem
from harness import run_together
from models import Deep, micro_batch
from setups import build_tiny_lm, parity_config
from zeromem.comm import Comm
from zeromem.stage3.partitioned_init import Partitions


def init_memory_and_values(rank, world_size):
    torch.manual_seed(0)
    plain = Deep(width=256, depth=4)
    full_bytes = sum(p.nbytes for p in plain.parameters())
    torch.manual_seed(0)
    partitions = Partitions()  # explicit, not the default table
    with zeromem.Init(partitions=partitions):
        model = Deep(width=256, depth=4)
    held = partitions.held_bytes(model)
    engine = zeromem.initialize(model, parity_config(3, 1, 0.0, world_size), partitions=partitions)
    full = engine.full_state_dict()
    same = all(torch.equal(full[k], v) for k, v in plain.state_dict().items()) if full else True
    weight = model.layers[0].weight
    with zeromem.GatheredParameters(weight, partitions=partitions):  # the engine's units are there
        whole = tuple(weight.shape)
    unknown = zeromem.GatheredParameters(weight)  # the default table never saw this model
    own_table = whole == (256, 256) and not unknown.units and not unknown.loose
    return held / full_bytes, same and own_table


def test_init_partitions_while_building(world):
    for ratio, same in world["init_memory_and_values"]:
        assert ratio <= 0.6, ratio     # each rank holds half the model (plus padding)
        assert same                     # identical to building without Init


def gathered_edit(rank, world_size):
    engine = zeromem.initialize(build_tiny_lm(use_init=True), parity_config(3, 1, 0.0, world_size))
    weight = engine.module.fc1.weight
    with zeromem.GatheredParameters(weight):
        readable = tuple(weight.shape)
        before = weight.detach().clone()
    with zeromem.GatheredParameters(weight, modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.5)     # only rank 0 edits; the edit is broadcast on exit
    full = engine.full_state_dict()
    edited = bool((full["fc1.weight"] == 0.5).all()) if full else True
    tokens, targets = micro_batch(0, rank, 0)
    engine.backward(engine(tokens, targets))
    engine.step()                      # the edited master trains on
    after = engine.full_state_dict()
    moved = bool((after["fc1.weight"] != 0.5).any()) if after else True
    return readable, tuple(weight.shape), edited, moved, before.shape


def test_gathered_parameters_read_and_modify(world):
    for readable, outside, edited, moved, shape in world["gathered_edit"]:
        assert readable == (7, 10) and outside == (0,)
        assert edited and moved and tuple(shape) == (7, 10)


def test_meta_device_model_is_materialised_like_an_ordinary_build():
    torch.manual_seed(0)
    plain = Deep(width=16, depth=3)
    with torch.device("meta"):
        model = Deep(width=16, depth=3)
    torch.manual_seed(0)  # the same draws, in the same module order
    engine = zeromem.initialize(model, parity_config(3, 1, 0.0, 1))  # no process group: world size 1
    full = engine.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in plain.state_dict().items())
    engine.backward(engine(torch.randn(2, 16)))
    engine.step()
    assert engine.global_steps == 1


def gpt_under_init(rank, world_size):
    from gpt import GPT, Block, GPTConfig  # re-initialises its children with self.apply(...)
    shape = GPTConfig(block_size=16, n_layer=2, n_embd=32)
    torch.manual_seed(0)
    plain = GPT(shape)
    torch.manual_seed(0)
    with zeromem.Init():
        model = GPT(shape)
    engine = zeromem.initialize(model, parity_config(3, 1, 0.0, world_size), fetch_units=(Block,))
    full = engine.full_state_dict()
    return all(torch.equal(full[k], v) for k, v in plain.state_dict().items()) if full else True


def test_init_sees_whole_parameters_in_a_parents_apply_init(world):
    assert all(world["gpt_under_init"])


class WritesThroughViews(torch.nn.Module):
    """Re-initialises attached children through views, as HF BERT and T5 do."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.proj = torch.nn.Linear(6, 6)
        self.scale = torch.nn.Parameter(torch.randn(6))   # the outermost module's own
        self.register_buffer("noise", torch.randn(5))      # never partitioned
        with torch.no_grad():
            self.proj.weight.data[:, 1].normal_()         # .data, then a view of it
            row = self.embed.weight[3]                    # a view that outlives a whole write:
            torch.nn.init.ones_(self.embed.weight)
            row.mul_(2.0)                                 # row 3 becomes 2, the rest 1
            torch.nn.init.zeros_(self.embed.weight[0])    # BERT: init.zeros_(weight[padding_idx])


def init_vs_plain(seed_of_rank: int, config: dict | None = None) -> tuple[float, float]:
    """Max difference from the plain build (seed 0), and the error in embed row 0."""
    torch.manual_seed(0)
    plain = WritesThroughViews()
    torch.manual_seed(seed_of_rank)
    partitions = Partitions()
    with zeromem.Init(config=config, partitions=partitions):
        model = WritesThroughViews()
    partitions.materialize(model.parameters(), Comm(None))
    reference = plain.state_dict()
    diff = {k: float((v - reference[k]).abs().max()) for k, v in model.state_dict().items()}
    return max(diff.values()), float(model.embed.weight.detach()[0].abs().max()), diff


def views_and_seeds(rank, world_size):
    return init_vs_plain(0), init_vs_plain(rank)


def test_init_keeps_writes_through_views_and_takes_rank0_values(world):
    for same_seed, own_seed in world["views_and_seeds"]:
        assert same_seed[:2] == (0.0, 0.0), same_seed  # writes through views are not lost
        assert own_seed[:2] == (0.0, 0.0), own_seed    # rank 0's parameters and buffers win


def nvme_config(world_size: int, path: str) -> dict:
    cfg = parity_config(3, 1, 0.0, world_size)
    cfg["zero_optimization"] |= {"offload_param": {"device": "nvme", "nvme_path": path},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": path}}
    return cfg


def init_on_nvme(rank, world_size, path):
    """Init with parameters on NVMe: shards in init.swp while building (none in memory),
    re-initialisation by the parent and writes through views reach the file, the engine
    builds from it, and the file goes once the engine has taken every shard."""
    from gpt import GPT, Block, GPTConfig
    shape = GPTConfig(block_size=16, n_layer=2, n_embd=32)
    torch.manual_seed(0)
    plain = GPT(shape)
    cfg = nvme_config(world_size, path)
    torch.manual_seed(0)
    partitions = Partitions()
    with zeromem.Init(config=cfg, partitions=partitions):
        model = GPT(shape)
    held = partitions.held_bytes(model)
    files = sorted(Path(path).glob(f"zeromem-rank{rank}-*/init.swp"))
    engine = zeromem.initialize(model, cfg, fetch_units=(Block,), partitions=partitions)
    full = engine.full_state_dict()
    same = all(torch.equal(full[k], v) for k, v in plain.state_dict().items()) if full else True
    gc.collect()
    left = [f for f in files if f.exists()]
    views = init_vs_plain(rank, nvme_config(world_size, path))[:2]
    engine.close()
    return held, len(files), same, left, views


def test_init_writes_shards_to_nvme_while_building(world):
    for held, files, same, left, views in world["init_on_nvme"]:
        assert held == 0 and files == 1, (held, files)  # every shard in the rank's init.swp
        assert same                 # the parent's apply(init) reached the file; built from it
        assert left == [], left      # removed once the engine holds every parameter
        assert views == (0.0, 0.0), views  # writes through views too, and rank 0's values


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, list]:
    """This file's 2-rank cases in one spawned world (spawning costs more than a case);
    the memory one first, before other cases' allocations."""
    return run_together({"init_memory_and_values": (init_memory_and_values, ()),
                         "gathered_edit": (gathered_edit, ()),
                         "gpt_under_init": (gpt_under_init, ()),
                         "views_and_seeds": (views_and_seeds, ()),
                         "init_on_nvme": (init_on_nvme,
                                          (str(tmp_path_factory.mktemp("nvme")),))}, 2)
