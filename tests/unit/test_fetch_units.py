"""The default stage-3 fetch units (stage3/units.py) on real model shapes, no process group."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gpt import GPT, Block, GPTConfig
from setups import hf_tiny_builders
from zeromem.offload.budget import PARAMS_SHARE, pool_unit_numel
from zeromem.planning.model_shapes import shape_of
from zeromem.stage3.units import (UnitCaps, coalesce_target_numel, default_target, describe,
                                  plan_fetch_units, unmerged_units)


def repeated_blocks(root: nn.Module) -> list[nn.Module]:
    """Children of every ModuleList / Sequential of two or more children of one class."""
    return [child for m in root.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
            and len(m) >= 2 and len({type(c) for c in m.children()}) == 1
            for child in m.children()]


def check_plan(root: nn.Module, units) -> dict[int, int]:
    """Invariants of any plan; returns parameter id -> unit index."""
    unit_of: dict[int, int] = {}
    for i, unit in enumerate(units):
        for p in unit.params:
            assert id(p) not in unit_of, f"a parameter in units {unit_of[id(p)]} and {i}"
            unit_of[id(p)] = i
    trainable = {id(p) for p in root.parameters() if p.requires_grad}
    assert set(unit_of) == trainable, "every trainable parameter in exactly one unit"
    for unit in units:  # every module registering a unit's parameter runs under a gatherer
        ids = {id(q) for q in unit.params}
        covered = {id(m) for k in unit.modules for m in k.modules()}
        for m in root.modules():
            if any(id(p) in ids for p in m.parameters(recurse=False)):
                assert id(m) in covered, type(m).__name__
    return unit_of


def check_default(root: nn.Module, min_blocks_per_unit: int = 1) -> list:
    units = plan_fetch_units(root)
    unit_of = check_plan(root, units)
    blocks = repeated_blocks(root)
    assert blocks, "the model has repeated blocks"
    for block in blocks:  # a block is never split between units
        assert len({unit_of[id(p)] for p in block.parameters()}) == 1, type(block).__name__
    per_unit = [sum(any(p is q for q in u.params) for p in (next(b.parameters()) for b in blocks))
                for u in units]
    assert max(per_unit) >= min_blocks_per_unit, per_unit
    target = coalesce_target_numel(sum(p.numel() for p in root.parameters() if p.requires_grad))
    for unit in units:  # a merged unit stays within the target; only a lone block may exceed it
        assert unit.numel <= target or "+" not in unit.kind and len(unit.modules) <= 2, unit.kind
    # a tied parameter's unit holds nothing else: its second user gathers only what it reads
    for unit in units:
        if unit.shared:
            assert len(unit.params) == 1, [tuple(p.shape) for p in unit.params]
    return units


def test_deep_gpt_merges_small_blocks_and_keeps_the_tied_embedding_alone():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=32, n_embd=64))
    units = check_default(model, min_blocks_per_unit=3)
    assert len(units) < 32 // 2, len(units)  # 32 blocks of ~50k elements -> ~9 units
    embed = next(u for u in units if any(p is model.token_embedding.weight for p in u.params))
    assert embed.shared and any(m is model.head for m in embed.modules)  # the tied head too
    target = default_target(unmerged_units(model), UnitCaps())
    report = describe(units, {id(m): n for n, m in model.named_modules()}, (), target)
    assert f": {len(units)}" in report and "blocks.3" in report and f"{target:,}" in report


def test_small_gpt_keeps_one_block_per_unit():
    torch.manual_seed(0)
    model = GPT()  # 6 blocks of ~790k elements: each over the merge target on its own
    units = check_default(model)
    assert sum(u.kind == "block" for u in units) == 6, [u.kind for u in units]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_blocks_become_units(name):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = hf_tiny_builders()[name]()
    units = check_default(model)
    layers = model.transformer.h if name == "gpt2" else model.model.layers
    # every decoder layer's parameters in one unit, not one unit per Linear
    assert len(units) < sum(1 for m in layers.modules() if isinstance(m, nn.Linear)
                            or type(m).__name__ == "Conv1D")


def test_a_frozen_layer_and_a_parameter_shared_inside_a_block():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(8, 8)
            self.stem.requires_grad_(False)
            self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
            self.layers[2].weight = self.layers[0].weight  # shared inside the repeated list
            self.out = nn.Linear(8, 2)

    model = Mixed()
    units = plan_fetch_units(model)
    check_plan(model, units)
    shared = next(u for u in units if any(p is model.layers[0].weight for p in u.params))
    assert any(m is model.layers[2] for m in shared.modules)


def test_user_fetch_units_win():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=4, n_embd=32))
    by_block = plan_fetch_units(model, (Block,))
    check_plan(model, by_block)
    assert [u.kind for u in by_block].count("user") == 4
    by_linear = plan_fetch_units(model, (nn.Linear,))
    check_plan(model, by_linear)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)
               and any(p.requires_grad for p in m.parameters(recurse=False))]
    assert [u.kind for u in by_linear].count("user") == len(linears)
    assert all(len(u.modules) == 1 or u.shared for u in by_linear), "nothing merged"


def test_merged_units_stay_within_the_reduce_bucket():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=32, n_embd=64))  # 4 blocks a unit uncapped
    units = plan_fetch_units(model, caps=UnitCaps(120_000))  # a unit is reduced as one bucket
    check_plan(model, units)
    assert max(u.numel for u in units) <= 120_000
    assert any("+" in u.kind or len(u.modules) > 1 for u in units), "still merged"


def test_nvme_parameter_pool_bounds_merging_whatever_the_depth():
    """With parameters on NVMe the pool holds at most buffer_count shards of the largest unit: merging
    stops at the pool's share of the budget, so the pool is the same at 8 and 32 layers
    (issue 16); merging up to the largest unmerged unit (a block) costs the pool nothing."""
    budget, buffers, world = 4 << 20, 5, 2
    cap = pool_unit_numel(budget, buffers, 4, world)
    assert cap == budget // PARAMS_SHARE // buffers // 4 * world
    largest = {}
    for depth in (8, 32):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(384, 384) for _ in range(depth)))
        units = plan_fetch_units(model, caps=UnitCaps(None, cap))
        check_plan(model, units)
        largest[depth] = max(u.numel for u in units)
        assert largest[depth] <= cap
        assert max(u.numel for u in plan_fetch_units(model)) > cap or depth == 8  # uncapped
    assert largest[8] == largest[32] == 384 * 385
    wide = nn.Sequential(nn.Linear(512, 512), *(nn.Linear(64, 64) for _ in range(12)))
    units = plan_fetch_units(wide, caps=UnitCaps(None, 1))  # a pool of the wide layer's shards
    assert max(u.numel for u in units) == 512 * 513 and len(units) == 2, len(units)


@pytest.mark.parametrize("caps", [UnitCaps(), UnitCaps(120_000), UnitCaps(None, 100_000),
                                  UnitCaps(90_000, 150_000)])
def test_planner_merges_units_as_the_engine_does(caps):
    """`ModelShape.with_unit_caps` merges the planner's unmerged units to the engine's units,
    in the engine's group order (latest registered first)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=32, n_embd=64))
    order = {id(p): i for i, p in enumerate(model.parameters())}
    units = plan_fetch_units(model, caps=caps)
    engine = [u.numel for u in sorted(units, key=lambda u: -min(order[id(p)] for p in u.params))]
    with torch.device("meta"):
        shape = shape_of(GPT(GPTConfig(block_size=32, n_layer=32, n_embd=64)))
    assert list(shape.with_unit_caps(caps).unit_numels) == engine
    assert shape.unit_numels == shape.with_unit_caps(UnitCaps()).unit_numels


def top_names(model: nn.Module, unit) -> list[str]:
    """The unit's parameters, named down to the decoder layer (h.0, layers.1) or module."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for p in unit.params:
        parts = names[id(p)].split(".")
        cut = next((i + 2 for i, part in enumerate(parts) if part in ("h", "layers")), -1)
        name = ".".join(parts[:cut])
        if name not in out:
            out.append(name)
    return out


@pytest.mark.parametrize("name, expected", [
    # the tied embedding alone (its head runs at the other end); each block whole, with
    # the small module before or after it: fewer units than blocks + 1
    ("gpt2", [["transformer.wte"], ["transformer.wpe", "transformer.h.0"],
              ["transformer.h.1", "transformer.ln_f"]]),
    ("llama", [["model.embed_tokens", "model.layers.0"],
               ["model.layers.1", "model.norm", "lm_head"]]),
])
def test_hugging_face_default_units_are_the_blocks_with_their_neighbours(name, expected):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = hf_tiny_builders(seq=64)[name]()  # as benchmarks/bench_models.py builds them
    units = plan_fetch_units(model)
    check_plan(model, units)
    assert [top_names(model, u) for u in units] == expected


PERSISTENT = UnitCaps(persistent_numel=100_000)  # stage3_param_persistence_threshold's default


def test_tiny_hugging_face_gpt2_merges_its_persistent_units():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = hf_tiny_builders(seq=64)["gpt2"]()  # ~120k elements, every unit under 100k
    units = plan_fetch_units(model, caps=PERSISTENT)
    check_plan(model, units)
    # the tied embedding (16k) joins wpe + h.0 (54k); h.1 + ln_f (50k) would pass 100k
    assert [top_names(model, u) for u in units] == [
        ["transformer.wte", "transformer.wpe", "transformer.h.0"],
        ["transformer.h.1", "transformer.ln_f"]]
    assert units[0].kind == "persistent" and units[0].shared


def test_persistent_units_merge_wherever_they_are_under_the_threshold():
    torch.manual_seed(0)
    model = GPT()  # small GPT: tied embedding (65k), positions (33k), ln_final; 6 big blocks
    plain = plan_fetch_units(model)
    units = plan_fetch_units(model, caps=PERSISTENT)
    check_plan(model, units)
    assert [u.kind for u in units] == ["persistent"] + ["block"] * 6
    kept = units[0]
    assert kept.shared and kept.numel == sum(u.numel for u in plain if u.numel < 100_000)
    assert kept.numel < 100_000  # still persistent: the engine keeps it whole
    assert any(m is model.ln_final for m in kept.modules)  # from the far end of the model
    assert [[id(p) for p in u.params] for u in units[1:]] == [
        [id(p) for p in u.params] for u in plain if u.numel >= 100_000]
    capped = plan_fetch_units(model, caps=UnitCaps(70_000, None, 100_000))  # one bucket each
    check_plan(model, capped)
    assert [u.numel for u in capped if u.numel < 100_000] == [65_536, 32_768 + 512]
    under = plan_fetch_units(model, caps=UnitCaps(persistent_numel=90_000))
    assert [u.numel for u in under if u.numel < 90_000] == [65_536, 32_768 + 512]


def test_planner_merges_persistent_units_as_the_engine_does():
    for caps in (PERSISTENT, UnitCaps(70_000, None, 100_000)):
        torch.manual_seed(0)
        model = GPT()
        order = {id(p): i for i, p in enumerate(model.parameters())}
        units = plan_fetch_units(model, caps=caps)
        engine = [u.numel for u in sorted(units, key=lambda u: -min(order[id(p)]
                                                                  for p in u.params))]
        with torch.device("meta"):
            shape = shape_of(GPT())
        assert list(shape.with_unit_caps(caps).unit_numels) == engine


def test_nvme_units_merge_layers_the_default_budget_can_hold():
    """The issue-16 model at W=1024 (Linear(1024, 1024) layers, fp32, 2 ranks, a 64 MiB
    budget (the default until stop 57) and 5 parameter buffers): the pool's share lets units of several layers
    form; a quarter of the budget kept every layer a unit of its own, 16 gathers, releases
    and buckets where CPU offload has 8."""
    layer = 1024 * 1024 + 1024
    cap = pool_unit_numel(64 << 20, 5, 4, 2)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(16)))
    units = plan_fetch_units(model, caps=UnitCaps(None, cap))
    check_plan(model, units)
    assert cap >= 2 * layer and len(units) <= 8, [u.numel for u in units]
