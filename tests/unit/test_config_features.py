"""DeepSpeed features outside the schema: accepted while off, refused (or warned) when on."""
from __future__ import annotations

import json
import logging
import math
import pickle

import pytest

from zeromem.config import features
from zeromem.config.schema import Config, ConfigError, Unsupported
from zeromem.config.support import check_supported_keys

ENABLED = ({"enabled": False}, {"enabled": True})
# feature key -> (a value that leaves it off, a value that turns it on)
SAMPLES = {
    "compression_training": ({"weight_quantization": {"shared_parameters": {"enabled": False}},
                              "layer_reduction": {"enabled": False}},
                             {"layer_reduction": {"enabled": True, "keep_number_layer": 6}}),
    "sparse_attention": ({}, {"mode": "fixed", "block": 16}),
    "datastates_ckpt": (False, {"host_cache_size": 16}),
    "weight_quantization": (None, {"post_init_quant": {"fc": {"num_bits": 8}}}),
    "compile": ({"deepcompile": False, "passes": ["autosp"]}, {"deepcompile": True}),
    "tensor_parallel": ({"autotp_size": 1}, {"autotp_size": 4}),
    "pipeline": ({}, {"stages": "auto", "partition": "best"}),
    "sequence_parallel_size": (1, 2),
    "seq_parallel_communication_data_type": ("fp32", "bf16"),
    "use_data_before_expert_parallelism": (False, True),
    "sparse_gradients": (False, True),
    "gradient_allreduce_op": ("mean", "sum"),
    "disable_allgather": (False, True),
    "graph_harvesting": (False, True),
    "managed_gradient_accumulation": (True, False),
    "hybrid_engine.inference_tp_size": (1, 2),  # inside a block that is a feature itself
    "zero_optimization.zenflow": (None, {"topk_ratio": 0.1, "update_interval": 4}),
    "zero_optimization.allgather_sequential": (False, True),
    "zero_optimization.stage3_allgather_sequential": (False, True),
    "zero_optimization.enable_sanity_checks": (False, True),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (False, True),
    "bf16.check_grad_overflow": (True, False),
    "disable_python_gc": (False, True),
    "vocabulary_size": (50304, 50257),  # warned only when not a multiple of 8, as DeepSpeed
    "zero_optimization.compute_grad_norm": (True, False),
    "zero_optimization.parameter_alignment": (False, True),
    "zero_optimization.offload_optimizer.super_offload": (False, True),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (0.8, 0.9),
    "optimizer.legacy_fusion": (False, True),
    "checkpoint.writer": (None, {"type": "fast", "io_buffer_size": 1e9}),
    "checkpoint.checkpoint_serialization": (True, False),
}
# blocks a nested key needs besides itself
CONTEXT = {"optimizer": {"type": "AdamW"}, "offload_optimizer": {"device": "cpu"}}


def with_value(key: str, value) -> dict:
    *parents, leaf = key.split(".")
    data: dict = {}
    inner = data
    for name in parents:
        inner = inner.setdefault(name, dict(CONTEXT.get(name, {})))
    inner[leaf] = value
    return data


def sample(feature: features.Feature) -> tuple:
    return SAMPLES.get(feature.key, ENABLED)


def test_every_feature_has_samples():
    assert set(SAMPLES) <= set(features.BY_KEY)
    generic = [f.key for f in features.FEATURES if f.key not in SAMPLES]
    for key in generic:  # only blocks switched by "enabled" may use the generic sample
        assert features.BY_KEY[key].active(key, {"enabled": True}), key


@pytest.mark.parametrize("feature", features.FEATURES, ids=lambda f: f.key)
def test_a_feature_left_off_is_accepted_and_kept_as_inert(feature):
    off, _ = sample(feature)
    config = Config.load(with_value(feature.key, off))
    assert config.inert[feature.key] == off
    assert all(k == feature.key or feature.key.startswith(f"{k}.") for k in config.inert)
    assert f"{feature.key} " in config.describe() and "accepted off" in config.describe()


@pytest.mark.parametrize("feature", [f for f in features.FEATURES if f.effect == "refuse"],
                         ids=lambda f: f.key)
def test_a_feature_turned_on_is_refused_naming_key_feature_and_why(feature):
    _, on = sample(feature)
    with pytest.raises(Unsupported) as info:
        Config.load(with_value(feature.key, on))
    error = info.value
    assert (error.key, error.feature, error.reason) == (feature.key, feature.name, feature.reason)
    assert str(error).startswith(f"{feature.key}") and feature.name in str(error)
    assert feature.reason in str(error)


@pytest.mark.parametrize("feature", [f for f in features.FEATURES if f.effect == "warn"],
                         ids=lambda f: f.key)
def test_a_layout_knob_turned_on_warns(feature, caplog):
    _, on = sample(feature)
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        Config.load(with_value(feature.key, on))
    assert feature.key in caplog.text and "no effect" in caplog.text


def test_deepspeed_chats_hybrid_engine_runs_as_without_it(caplog):
    """DeepSpeed-Chat's --enable_hybrid_engine block: generation is not sped up, nothing
    else changes, so it is accepted with a warning; sharding generation over ranks
    (inference_tp_size > 1) is refused."""
    block = {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1,
             "release_inference_cache": False, "pin_parameters": True,
             "tp_gather_partition_size": 8}
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        config = Config.load({"hybrid_engine": block})
    assert "hybrid_engine" in caplog.text and "generation runs as without it" in caplog.text
    assert config.inert["hybrid_engine"]["enabled"] is True
    with pytest.raises(Unsupported, match="hybrid_engine.inference_tp_size = 2"):
        Config.load({"hybrid_engine": {**block, "inference_tp_size": 2}})


def test_a_misspelt_switch_is_an_error_not_off():
    with pytest.raises(ConfigError, match="did you mean 'enabled'"):
        Config.load({"progressive_layer_drop": {"enable": True, "theta": 0.5}})
    with pytest.raises(ConfigError, match=r"hybrid_engine.enabled must be true or false"):
        Config.load({"hybrid_engine": {"enabled": "auto"}})
    with pytest.raises(ConfigError, match="eigenvalue must be an object"):
        Config.load({"eigenvalue": True})


def test_a_misspelt_feature_name_gets_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'progressive_layer_drop'"):
        Config.load({"progresive_layer_drop": {"enabled": True}})


def test_a_key_that_is_not_deepspeeds_stays_an_error():
    with pytest.raises(ConfigError) as info:
        Config.load({"train_batch_size": 8, "cuda_visible_devices": 0})
    message = str(info.value)
    assert not isinstance(info.value, Unsupported)
    assert "'cuda_visible_devices'" in message and "not a DeepSpeed or zeromem key" in message
    assert '"ignore_unknown_keys": true' in message


def test_the_opt_out_drops_unknown_top_level_keys_with_a_warning(caplog):
    data = {"train_batch_size": 8, "cuda_visible_devices": 0, "my_notes": {"a": 1},
            "zeromem": {"ignore_unknown_keys": True}}
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        config = Config.load(data)
    assert config.train_batch_size == 8
    assert "'cuda_visible_devices'" in caplog.text and "'my_notes'" in caplog.text
    # only keys that are no one's: a typo inside a block, or an enabled feature, still fails
    with pytest.raises(ConfigError, match="did you mean 'reduce_bucket_size'"):
        Config.load({**data, "zero_optimization": {"reduce_bucket_sise": 1}})
    with pytest.raises(Unsupported, match="progressive_layer_drop"):
        Config.load({**data, "progressive_layer_drop": {"enabled": True}})


def test_dotted_top_level_keys_are_ignored_as_deepspeed_ignores_them(caplog):
    """TRL's prepare_deepspeed writes "zero_optimization.reduce_bucket_size" (and a fractional
    prefetch size) at the top level for its reference model; DeepSpeed ignores such keys,
    so its runs of those recipes used the block as it was: so do ours, with a warning."""
    data = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "reduce_bucket_size": 100},
            "zero_optimization.reduce_bucket_size": 64,
            "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64}
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        config = Config.load(data)
    assert config.zero_optimization.reduce_bucket_size == 100
    assert config.zero_optimization.stage3_prefetch_bucket_size == 50_000_000  # the default
    assert "'zero_optimization.reduce_bucket_size' = 64 ignored" in caplog.text
    with pytest.raises(ConfigError, match="zero_optimisation.stage"):  # no block of that name
        Config.load({"train_batch_size": 8, "zero_optimisation.stage": 3})


def test_refusals_keep_their_kind_through_files_and_pickles(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}))
    with pytest.raises(Unsupported) as info:
        Config.load(path)
    error = info.value
    assert str(error).startswith(f"{path}: optimizer.type = 'OneBitAdam' is not supported (1-bit Adam)")
    assert error.key == "optimizer.type" and "1-bit signs" in error.reason
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is Unsupported and str(copy) == str(error) and copy.key == error.key


@pytest.mark.parametrize("name", ["OneBitAdam", "OnebitAdam", "ZeroOneAdam", "OneBitLamb",
                                  "onebitlamb", "MuAdam"])
def test_communication_compressing_and_mup_optimizers_are_refused(name):
    with pytest.raises(Unsupported, match=f"optimizer.type = '{name}' is not supported"):
        Config.load({"optimizer": {"type": name, "params": {"lr": 1e-3, "freeze_step": 10}}})


def test_refused_knobs_are_unsupported_too():
    with pytest.raises(Unsupported, match="gradient_predivide_factor = 8.0 is not supported"):
        check_supported_keys(Config.load({"gradient_predivide_factor": 8}))
    check_supported_keys(Config.load({"prescale_gradients": True}))  # zeromem always prescales


def test_steps_per_print_infinity_means_never():
    assert Config.load({"steps_per_print": math.inf}).steps_per_print == math.inf
    assert Config.load('{"steps_per_print": Infinity}').steps_per_print == math.inf
    assert Config.load({"steps_per_print": 5.0}).steps_per_print == 5  # a whole float is fine
    for bad in (0, -math.inf, math.nan, 2.5, True, "10"):
        with pytest.raises(ConfigError, match="steps_per_print"):
            Config.load({"steps_per_print": bad})


def test_sparse_gradients_is_accepted_with_a_warning(caplog):
    """Sparse embeddings train (their gradients reduced dense): DeepSpeed users' key is no
    reason to refuse the config."""
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        Config.load({"sparse_gradients": True})
    assert "sparse_gradients" in caplog.text and "dense" in caplog.text
