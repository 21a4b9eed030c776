"""Pure logic of `zeromem consolidate --hf` (no process group): shard packing against
huggingface_hub's own splitter, wrapper prefixes, sizes, dtypes, configs with code."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from zeromem.checkpoints.hf_export import (common_prefixes, output_dtype, parse_shard_size,
                                           plan_shards, shard_files, strip_prefix)
from zeromem.checkpoints.tensor_files import CheckpointError

hub = pytest.importorskip("huggingface_hub")


def test_shards_are_packed_as_huggingface_hub_packs_them():
    rng = random.Random(0)
    for trial in range(200):
        sizes = [(f"t{i}", rng.choice([1, 7, 40, 99, 100, 101, 250])) for i in range(rng.randint(1, 12))]
        limit = rng.choice([1, 100, 150, 400])
        state = {name: torch.empty(n, dtype=torch.uint8) for name, n in sizes}
        theirs = hub.split_torch_state_dict_into_shards(
            state, filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
        ours = plan_shards(sizes, limit)
        assert dict(zip(shard_files(len(ours)), ours)) == theirs.filename_to_tensors, (sizes, limit)


def test_an_empty_model_is_one_empty_file():
    assert plan_shards([], 10) == [[]] and shard_files(1) == ["model.safetensors"]


def test_wrapper_prefix_is_the_shortest_that_gives_the_models_names():
    assert common_prefixes(["a.b.w", "a.b.v", "a.c"]) == ["", "a."]
    model = {"model.embed.weight", "lm_head.weight"}
    assert strip_prefix(["model.embed.weight", "lm_head.weight"], model) == ""
    assert strip_prefix(["module.model.embed.weight", "module.lm_head.weight"], model) == "module."
    assert strip_prefix(["_orig_mod.module.model.embed.weight", "_orig_mod.module.lm_head.weight"],
                        model) == "_orig_mod.module."
    # none fits: the prefix matching most names, for the error message
    assert strip_prefix(["module.model.embed.weight", "module.head.weight"], model) == "module."


def test_shard_sizes_are_read_as_hf_writes_them():
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size("20KB") == 20_000
    assert parse_shard_size(1234) == 1234
    with pytest.raises(CheckpointError, match="positive"):
        parse_shard_size("0MB")


def test_dtype_is_the_override_then_the_config_then_the_training():
    manifest = {"dtypes": {"compute": "bfloat16"}}
    assert output_dtype(None, SimpleNamespace(dtype=None), manifest) == torch.bfloat16
    assert output_dtype(None, SimpleNamespace(dtype="float16"), manifest) == torch.float16
    assert output_dtype(None, SimpleNamespace(dtype=torch.float32), manifest) == torch.float32
    assert output_dtype("fp32", SimpleNamespace(dtype="float16"), manifest) == torch.float32
    with pytest.raises(CheckpointError, match="the config's dtype is 'int8'"):
        output_dtype(None, SimpleNamespace(dtype="int8"), manifest)


def test_a_config_that_needs_its_own_code_is_refused_without_running_it(tmp_path):
    pytest.importorskip("transformers")
    from zeromem.checkpoints.hf_export import read_hf_model

    (tmp_path / "config.json").write_text(
        '{"model_type": "mystery", "auto_map": {"AutoConfig": "conf.MyConfig"}}')
    ran = tmp_path / "ran"
    (tmp_path / "conf.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    with pytest.raises(CheckpointError, match="custom code"):
        read_hf_model(tmp_path)
    assert not ran.exists()
