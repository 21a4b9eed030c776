"""ZeRO-3 leaf modules (`zero_optimization.leaf_module`, config/leaf_modules.py, and the
modules `deepspeed.utils.set_z3_leaf_modules` flags): which modules are leaves, and that
the stage-3 fetch units never split one (stage3/units.py). No process group."""
from __future__ import annotations

import logging

import pytest

from torch import nn

from models import SparseExperts
from zeromem.config.schema import Config
from zeromem.deepspeed import utils
from zeromem.planning.model_shapes import shape_of
from zeromem.planning.planner import predict_memory
from zeromem.stage3.units import UnitCaps, plan_fetch_units, unmerged_units


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), SparseExperts(), nn.Linear(4, 2))


def leaves(block: dict | None, root: nn.Module) -> list[nn.Module]:
    zero = {"stage": 3} if block is None else {"stage": 3, "leaf_module": block}
    config = Config.load({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    return config.zero_optimization.leaf_module.modules(root)


@pytest.mark.parametrize("block, expected", [
    ({"classes": ["SparseExperts"]}, ["1"]),
    ({"classes": f"{SparseExperts.__module__}.SparseExperts"}, ["1"]),  # qualified, given bare
    ({"classes": ["Linear"]}, ["0", "1.gate", "1.experts.0", "1.experts.1", "1.experts.2", "2"]),
    ({"names": ["1.gate", "2"]}, ["1.gate", "2"]),
    ({"name_suffixes": ["experts.1", "2"]}, ["1.experts.1", "1.experts.2", "2"])])
def test_a_leaf_is_named_by_its_class_its_name_or_the_end_of_it(block, expected):
    root = model()
    names = {id(m): name for name, m in root.named_modules()}
    assert [names[id(m)] for m in leaves(block, root)] == expected


def test_deepspeeds_default_leaves_are_hugging_faces_moe_blocks(caplog):
    """DeepSpeed (0.18 on) makes HF's Mixtral, Qwen2-MoE and Qwen3-MoE blocks leaves in any
    model with no `leaf_module` in its config; a model without them gets none, silently."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        num_local_experts=4, num_experts_per_tok=2, vocab_size=64)
    with caplog.at_level(logging.WARNING, "zeromem"):
        found = leaves(None, transformers.MixtralForCausalLM(config))
        assert leaves(None, model()) == []
    assert [type(m).__name__ for m in found] == ["MixtralSparseMoeBlock"] * 2
    assert not caplog.records


def test_a_name_that_matches_nothing_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, "zeromem"):
        assert leaves({"names": ["2.experts"], "classes": ["SparseExperts"]}, model())
    assert "['2.experts'] match no module" in caplog.text


def test_deepspeeds_flags_make_leaves_and_unflagging_undoes_them():
    root = model()
    assert utils.set_z3_leaf_modules(root, ["SparseExperts"]) == [root[1]]
    assert leaves(None, root) == [root[1]]
    found, missing = utils.set_z3_leaf_modules_by_name(root, ["2", "9"], raise_if_not_found=False)
    assert found == [root[2]] and missing == ["9"]
    assert leaves(None, root) == [root[1], root[2]]
    utils.unset_z3_leaf_modules(root, [SparseExperts])
    utils.set_z3_leaf_modules_by_suffix(root, ["2"], flag=False)
    assert leaves(None, root) == []
    with pytest.raises(ValueError, match="no module named"):
        utils.set_z3_leaf_modules_by_suffix(root, ["nothing"])


def unit_of(units) -> dict[int, int]:
    return {id(p): i for i, unit in enumerate(units) for p in unit.params}


@pytest.mark.parametrize("user", [(), (nn.Linear,)])
def test_the_fetch_units_never_split_a_leaf(user):
    """Without leaves each expert is a unit of its own (gathered when it runs, in the order
    each rank's data picks); a leaf is one unit, whatever the policy (the default one, or
    the user's `fetch_units`, which would cut it into its Linears)."""
    root = model()
    expert_params = list(root[1].parameters())
    split = unit_of(unmerged_units(root))
    assert len({split[id(p)] for p in expert_params}) == 4
    caps = UnitCaps(bucket_numel=1)  # nothing merged: only the leaf holds several modules
    for units in (unmerged_units(root, leaves=[root[1]]),
                  plan_fetch_units(root, user, caps, leaves=[root[1]])):
        whole = unit_of(units)
        assert len({whole[id(p)] for p in expert_params}) == 1
        assert units[whole[id(expert_params[0])]].kind == "leaf"
        assert set(whole) == {id(p) for p in root.parameters()}


def test_the_planner_keeps_a_leaf_whole_as_the_engine_does():
    """`shape_of` (and `predict_memory`, from the config's `leaf_module`) merges the units
    the engine builds: the leaf one unit, in the engine's group order."""
    root = model()
    order = {id(p): i for i, p in enumerate(root.parameters())}
    caps = UnitCaps(bucket_numel=30)  # neighbours merge up to 30 elements; the leaf is 75
    for leaf in ([], [root[1]]):
        units = plan_fetch_units(root, caps=caps, leaves=leaf)
        engine = [u.numel for u in sorted(units, key=lambda u: -min(order[id(p)] for p in u.params))]
        assert list(shape_of(root, leaves=leaf).with_unit_caps(caps).unit_numels) == engine, leaf
    assert 75 in engine  # gate 15 + three experts 20 each, one unit
    zero = {"stage": 3, "reduce_bucket_size": 30, "stage3_param_persistence_threshold": 0}
    whole, split = (predict_memory(root, {"train_micro_batch_size_per_gpu": 1,
                                          "zero_optimization": {**zero, **leaf}}, 2, "gloo", "cpu")
                    for leaf in ({"leaf_module": {"classes": ["SparseExperts"]}}, {}))
    assert (whole.groups, split.groups) == (3, 5)  # the leaf one flat group, as in the engine
    utils.set_z3_leaf_modules(root, [SparseExperts])  # DeepSpeed's flag: a leaf by default
    assert list(shape_of(root).with_unit_caps(caps).unit_numels) == engine
