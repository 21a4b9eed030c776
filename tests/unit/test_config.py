"""Pure-logic tests of zeromem.config.schema: no process group."""

from __future__ import annotations

import json
import logging
import pickle
import re

import pytest

import torch

from zeromem.config import schema as config_module
from zeromem.config.schema import (Config, ConfigError, OptimizerConfig, ZeroConfig, check_supported,
                            resolve_batch)

BATCH = {"train_batch_size": 8}


def load_error(data, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        Config.load(data, **kwargs)
    return str(info.value)


@pytest.fixture
def everything_built(monkeypatch):
    """Pretend every feature is built, to test validation behind the NOT_BUILT gate."""
    monkeypatch.setattr(config_module, "NOT_BUILT", set())


# ---------------------------------------------------------------- unknown keys

def test_nested_typo_names_path_and_suggests():
    message = load_error({**BATCH, "zero_optimization": {"reduce_bucket_sise": 5}})
    assert "zero_optimization.reduce_bucket_sise" in message
    assert "did you mean 'reduce_bucket_size'?" in message


def test_top_level_typo_suggests():
    message = load_error({"train_batch_sise": 8})
    assert "'train_batch_sise'" in message and "did you mean 'train_batch_size'?" in message


def test_deeply_nested_typo():
    message = load_error({"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}})
    assert "zero_optimization.offload_optimizer.pin_memroy" in message
    assert "did you mean 'pin_memory'?" in message


def test_unknown_key_without_close_match_lists_valid_keys():
    message = load_error({"bf16": {"zzz": 1}})
    assert "bf16.zzz" in message and "enabled" in message and "immediate_grad_update" in message


def test_optimizer_param_typo_checked_against_torch_signature():
    message = load_error({"optimizer": {"type": "AdamW",
                                        "params": {"lr": 1e-3, "betaz": [0.9, 0.99]}}})
    assert "optimizer.params.betaz" in message and "did you mean 'betas'?" in message
    message = load_error({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}})
    assert "did you mean 'momentum'?" in message


def test_scheduler_param_typo_and_missing_required():
    message = load_error({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_step": 5}}})
    assert "scheduler.params.warmup_num_step" in message
    assert "did you mean 'warmup_num_steps'?" in message
    assert "scheduler.params.total_num_steps is required" in message


def test_multiple_problems_are_all_reported():
    message = load_error({"aaa": 1, "zero_optimization": {"stage": 9}})
    assert "2 problems" in message and "aaa" in message and "zero_optimization.stage" in message


# ---------------------------------------------------------------- types and values

@pytest.mark.parametrize("data, expected", [
    ({"zero_optimization": {"stage": 5}},
     "zero_optimization.stage must be one of 0, 1, 2, 3, got 5"),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage must be one of 0, 1, 2, 3"),
    ({"zero_optimization": {"reduce_bucket_size": 1.5}},
     "reduce_bucket_size must be a whole number"),
    ({"zero_optimization": {"reduce_bucket_size": True}}, "reduce_bucket_size must be an integer"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "reduce_bucket_size must be >= 1, got 0"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled must be true or false, got 'yes'"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping must be a number"),
    ({"gradient_clipping": -1}, "gradient_clipping must be >= 0"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device must be one of 'none', 'cpu', 'nvme', got 'gpu'"),
    ({"data_types": {"grad_accum_dtype": "float32"}}, "data_types.grad_accum_dtype must be one of"),
    ({"zero_optimization": 2}, "zero_optimization must be an object"),
    ({"optimizer": {"type": "Adafactor"}}, "optimizer.type must be one of 'Adam', 'AdamW', 'SGD'"),
    ({"optimizer": {"params": {}}}, "optimizer.type is required"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}},
     "scheduler.params.warmup_type must be one of 'log', 'linear', got 'cos'"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "needs nvme_path"),
])
def test_wrong_type_or_value_names_key_and_allowed(data, expected):
    assert expected in load_error(data)


def test_fp16_and_bf16_both_enabled():
    message = load_error({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled" in message


def test_fp16_master_weights_are_refused_not_ignored():
    from zeromem.config.support import check_supported_keys
    config = Config.load({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
                          "zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match="fp16.fp16_master_weights_and_grads = True is not "
                                          "supported: master weights and gradients are always"):
        check_supported_keys(config)


def test_offload_ratio_below_one_needs_stage_3(everything_built):
    message = load_error({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "ratio": 0.5}}})
    assert "offload_optimizer.ratio < 1 requires stage 3" in message


def test_source_of_the_wrong_kind():
    assert "dict, a JSON file path or a Config" in load_error(42)
    assert "world_size must be a positive integer" in load_error(BATCH, world_size=0)


# ---------------------------------------------------------------- batch triple

@pytest.mark.parametrize("given, expected", [
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 3}, (24, 4, 3)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4}, (24, 4, 3)),
    ({"train_batch_size": 24, "gradient_accumulation_steps": 3}, (24, 4, 3)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, (24, 4, 3)),
    ({"train_batch_size": 24}, (24, 12, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, (8, 4, 1)),
])
def test_batch_resolution_rules(given, expected):
    config = Config.load(given, world_size=2)
    resolved = (config.train_batch_size, config.train_micro_batch_size_per_gpu,
                config.gradient_accumulation_steps)
    assert resolved == expected
    assert all(config.value_at(k) is not None for k in given)


def test_batch_triple_that_does_not_multiply_out():
    message = load_error({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": 3}, world_size=1)
    assert "train_batch_size (10)" in message and "4 × 3 × 1 = 12" in message


@pytest.mark.parametrize("given", [
    {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
    {"train_batch_size": 10, "gradient_accumulation_steps": 4},
    {"train_batch_size": 9},
])
def test_batch_division_that_would_floor(given):
    message = load_error(given, world_size=2)
    assert "train_batch_size" in message and "not divisible" in message


def test_batch_needs_train_or_micro():
    message = load_error({"gradient_accumulation_steps": 2}, world_size=2)
    assert ("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
            in message)


def test_batch_resolution_waits_for_world_size():
    config = Config.load({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})
    assert config.gradient_accumulation_steps is None
    with pytest.raises(ConfigError, match="train_batch_size"):
        Config.load(config, world_size=2)  # re-resolved from the original input
    resolved = Config.load({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})
    assert Config.load(resolved, world_size=2).gradient_accumulation_steps == 2
    assert Config.load(resolved, world_size=4).gradient_accumulation_steps == 1


def test_resolve_batch_function_directly():
    assert resolve_batch(None, 2, 4, 8) == (64, 2, 4)
    with pytest.raises(ConfigError, match="train_batch_size"):
        resolve_batch(64, 3, None, 8)


# ---------------------------------------------------------------- "auto"

def test_auto_batch_keys_are_derived():
    config = Config.load({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": "auto"}, world_size=2)
    assert (config.train_batch_size, config.gradient_accumulation_steps) == (8, 1)
    assert "derived" in next(line for line in config.describe().splitlines()
                             if line.startswith("train_batch_size"))


def test_all_batch_keys_auto_is_an_error():
    message = load_error({k: "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                              "gradient_accumulation_steps")}, world_size=2)
    assert "Either train_batch_size" in message


def test_auto_from_hidden_size():
    data = {"zero_optimization": {"reduce_bucket_size": "auto", "prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto"}}
    zero = Config.load(data, hidden_size=1024).zero_optimization
    assert zero.reduce_bucket_size == 1024 * 1024
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert zero.stage3_param_persistence_threshold == 10 * 1024
    resolved = Config.load(Config.load({**data, **BATCH}, hidden_size=8), world_size=2)
    assert resolved.zero_optimization.reduce_bucket_size == 64  # hidden_size kept on re-resolve
    assert resolved.train_micro_batch_size_per_gpu == 4


def test_other_zero_sizes_and_placements_auto_are_zeromem_defaults():
    """OpenRLHF hands "auto" sizes straight to deepspeed.initialize, which drops them: each
    is left unset, so zeromem's default (derived from the model, for the buckets) applies."""
    auto = ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
            "stage3_max_live_parameters", "stage3_param_persistence_threshold")
    zero = Config.load({"zero_optimization": {"stage": 3, **{k: "auto" for k in auto},
                                              "offload_param": {"device": "auto"}}}
                       ).zero_optimization
    assert not zero.model_fields_set & set(auto) and zero.offload_param.device == "none"
    assert zero.stage == 3 and zero.sub_group_size == Config().zero_optimization.sub_group_size


@pytest.mark.parametrize("data, key", [
    ({"gradient_clipping": "auto"}, "gradient_clipping"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
    ({"fp16": {"enabled": "auto"}}, "fp16.enabled"),
    ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage"),
])
def test_underivable_auto_is_rejected_not_dropped(data, key):
    message = load_error(data, hidden_size=64)
    assert key in message and '"auto"' in message


# ---------------------------------------------------------------- features not built

@pytest.mark.parametrize("data, key", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"stage": 1, "cpu_offload": True}},
     "zero_optimization.offload_optimizer.device"),
])
def test_not_built_features_are_refused(monkeypatch, data, key):
    monkeypatch.setattr(config_module, "NOT_BUILT", {"offload_optimizer"})  # the gate itself
    message = load_error(data)
    assert key in message and "is not supported yet" in message


def test_offload_blocks_load_now_that_offload_is_built():
    config = Config.load({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "cpu"}}})
    zero = config.zero_optimization
    assert (zero.offload_optimizer_device, zero.offload_param_device) == ("nvme", "cpu")
    assert config.unsupported_features() == {}


def test_offload_param_not_built(monkeypatch):
    monkeypatch.setattr(config_module, "NOT_BUILT", {"offload_param"})
    message = load_error({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert "zero_optimization.offload_param.device" in message and "not supported yet" in message


def test_offload_param_below_stage_3_is_dropped_with_a_warning(everything_built, caplog):
    """DeepSpeed reads offload_param only at stage 3 and ignores it below: DeepSpeed-Chat's
    `--offload` writes it at every stage, Accelerate's plugin too when asked."""
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        config = Config.load({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                                                    "offload_optimizer": {"device": "cpu"}}})
    zero = config.zero_optimization
    assert (zero.offload_param_device, zero.offload_optimizer_device) == ("none", "cpu")
    assert "zero_optimization.offload_param" in caplog.text and "stage 2" in caplog.text


def test_removing_a_feature_from_not_built_lets_it_load(monkeypatch):
    data = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    monkeypatch.setattr(config_module, "NOT_BUILT", config_module.NOT_BUILT - {"offload_optimizer"})
    config = Config.load(data)
    assert config.zero_optimization.offload_optimizer_device == "cpu"
    assert config.unsupported_features() == {}


def test_stage_3_loads_with_overlap_on_by_default():
    config = Config.load({"zero_optimization": {"stage": 3}})
    assert config.zero_optimization.stage == 3 and config.zero_optimization.overlap_comm is True


def test_unsupported_features_report(monkeypatch):
    monkeypatch.setattr(config_module, "NOT_BUILT", {"offload_optimizer"})
    config = Config.model_validate({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu"}}})  # model_validate skips the gate; load would refuse
    assert config.unsupported_features() == {
        "offload_optimizer": "zero_optimization.offload_optimizer.device"}
    with pytest.raises(ConfigError, match="not supported yet"):
        check_supported(config)


def test_out_of_scope_features_are_refused():
    message = load_error({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}})
    assert "zero_optimization.zeropp_loco_param" in message and "not supported" in message


def test_zeropp_options_need_their_stage():
    for key, value in (("zero_quantized_weights", True), ("zero_quantized_gradients", True),
                       ("zero_hpz_partition_size", 2)):
        message = load_error({"zero_optimization": {"stage": 2, key: value}})
        assert "zero_optimization" in message and f"{key} requires stage 3" in message
    assert "requires stage 1, 2 or 3" in load_error({"zero_optimization": {"mics_shard_size": 2}})
    message = load_error({"zero_optimization": {"stage": 3, "mics_shard_size": 2,
                                                "zero_hpz_partition_size": 2}})
    assert "mics_shard_size with zero_hpz_partition_size is not supported" in message
    config = Config.load({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True},
                          "zeromem": {"cluster": {"ranks_per_node": 2,
                                                  "quantized_gradient_bits": 8}}})
    assert config.zeromem.cluster.quantized_gradient_bits == 8
    assert "zeromem.cluster.ranks_per_node" in config.describe()
    assert "quantized_gradient_bits" in load_error(
        {"zeromem": {"cluster": {"quantized_gradient_bits": 2}}})


# ---------------------------------------------------------------- aliases

def test_bfloat16_alias():
    config = Config.load({"bfloat16": {"enabled": True}})
    assert config.bf16.enabled and config.compute_dtype == torch.bfloat16


def test_thread_count_alias_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        config = Config.load({"aio": {"thread_count": 4}})
    assert config.aio.intra_op_parallelism == 4
    assert "thread_count" in caplog.text and "intra_op_parallelism" in caplog.text


def test_prefetch_bucket_size_alias():
    config = Config.load({"zero_optimization": {"prefetch_bucket_size": 1234}})
    assert config.zero_optimization.stage3_prefetch_bucket_size == 1234


def test_old_gather_fp16_weights_alias_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        config = Config.load(
            {"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert "deprecated" in caplog.text


def test_alias_and_current_name_together_is_an_error():
    message = load_error({"zero_optimization": {"prefetch_bucket_size": 1,
                                                "stage3_prefetch_bucket_size": 2}})
    assert "zero_optimization" in message and "give only 'stage3_prefetch_bucket_size'" in message
    assert "give only 'bf16'" in load_error({"bf16": {}, "bfloat16": {}})


def test_cpu_offload_maps_to_offload_optimizer(everything_built, caplog):
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        zero = Config.load({"zero_optimization": {
            "stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}}).zero_optimization
    assert zero.offload_optimizer_device == "cpu" and zero.offload_optimizer.pin_memory
    assert "cpu_offload" in caplog.text
    assert "cannot both be given" in load_error(
        {"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})


# ---------------------------------------------------------------- values

def test_bucket_floats_become_ints():
    zero = Config.load({"zero_optimization": {"reduce_bucket_size": 5e8,
                                              "allgather_bucket_size": 2e8}}).zero_optimization
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert type(zero.allgather_bucket_size) is int


def test_code_defaults():
    """DeepSpeed 0.19.8's: gradient_clipping 1.0 (0.0 before its PR 8068, and in zeromem
    before stop 49); 0.0 given turns it off."""
    config = Config.load({})
    zero = config.zero_optimization
    assert config.gradient_clipping == 1.0 and config.steps_per_print == 10
    assert Config.load({"gradient_clipping": 0.0}).gradient_clipping == 0.0
    assert zero.stage == 0 and zero.reduce_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000 and zero.overlap_comm is False
    assert zero.offload_optimizer is None and zero.offload_optimizer_device == "none"
    assert config.fp16.initial_scale_power == 16 and config.fp16.hysteresis == 2
    assert config.aio.intra_op_parallelism == 1 and config.checkpoint.tag_validation == "Warn"
    assert ZeroConfig(stage=3).overlap_comm is True


def test_load_from_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}))
    config = Config.load(path, world_size=2)
    assert config.train_batch_size == 8
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert Config.load(str(path)).zero_optimization.stage == 2


def test_json_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"zero_optimization": {"stgae": 2}}')
    message = load_error(path)
    assert str(path) in message and "did you mean 'stage'?" in message
    path.write_text("{not json")
    assert "not valid JSON" in load_error(path)
    assert "cannot read config file" in load_error(tmp_path / "missing.json")


@pytest.mark.parametrize("data, compute, grad", [
    ({}, torch.float32, torch.float32),
    ({"fp16": {"enabled": True}}, torch.float16, torch.float16),
    ({"bf16": {"enabled": True}}, torch.bfloat16, torch.bfloat16),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
     torch.bfloat16, torch.float32),
])
def test_compute_and_grad_dtype(data, compute, grad):
    config = Config.load(data)
    assert (config.compute_dtype, config.grad_dtype) == (compute, grad)


def test_param_dtype_may_only_repeat_the_precision_blocks():
    """DeepSpeed 0.19.8 asserts data_types.param_dtype matches the enabled block; before
    stop 49 zeromem refused the key even then."""
    assert Config.load({"bf16": {"enabled": True},
                        "data_types": {"param_dtype": "bf16"}}).compute_dtype == torch.bfloat16
    Config.load({"data_types": {"param_dtype": "fp32"}})
    for data in ({"data_types": {"param_dtype": "bf16"}},
                 {"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}}):
        with pytest.raises(ConfigError, match="data_types.param_dtype"):
            Config.load(data)


BF16_FULL = "tests/data/ds_config_corpus/DeepSpeedExamples/training/bf16_master_weight/configs/bf16_full.json"


def test_bf16_masters_load_where_deepspeed_runs_them():
    """DeepSpeedExamples' bf16_full.json (stage 3, both keys, torch_autocast) loads: bf16
    masters. Combinations DeepSpeed asserts against, or runs only with its CPU Adam, are
    refused naming the key."""
    assert Config.load(BF16_FULL).master_dtype == torch.bfloat16
    assert Config.load({"bf16": {"enabled": True}}).master_dtype == torch.float32
    offloaded = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                          "bf16_optimizer_states": True},
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert Config.load(offloaded).master_dtype == torch.bfloat16
    both = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    refused = {
        "bf16_optimizer_states needs": {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
        "bf16.bf16_optimizer_states too": {"bf16": {"enabled": True,
                                                   "bf16_master_weights_and_grads": True}},
        "needs bf16.enabled": {"bf16": {**both, "enabled": False}},
        "stage 1, 2 or 3": {"bf16": both, "zero_optimization": {"stage": 0}},
        "offload_optimizer.device": {"bf16": both, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
    }
    for words, data in refused.items():
        with pytest.raises(ConfigError, match=re.escape(words)):
            Config.load({"zero_optimization": {"stage": 2}, **data})


def test_checkpoint_block_is_case_insensitive():
    config = Config.load({"checkpoint": {"tag_validation": "FAIL",
                                         "parallel_write": {"pipeline_stage": True}}})
    assert config.checkpoint.tag_validation == "Fail"
    assert config.checkpoint.parallel_write.pipeline_stage


def test_describe_marks_sources():
    config = Config.load({"train_batch_size": 8, "zero_optimization": {"stage": 1}}, world_size=2)
    sources = {line.split()[0]: line.split()[-1] for line in config.describe().splitlines()}
    assert sources["train_batch_size"] == "file"
    assert sources["train_micro_batch_size_per_gpu"] == "derived"
    assert sources["zero_optimization.stage"] == "file"
    assert sources["zero_optimization.overlap_comm"] == "derived"
    assert sources["fp16.enabled"] == "default"


# ---------------------------------------------------------------- optimizer block

def test_optimizer_type_is_case_insensitive():
    optimizer = OptimizerConfig.model_validate(
        {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}})
    assert optimizer.type == "SGD" and optimizer.torch_class is torch.optim.SGD


def test_deepspeed_adam_decouples_weight_decay(caplog):
    with caplog.at_level(logging.WARNING, logger="zeromem"):
        optimizer = Config.load({"optimizer": {"type": "Adam", "params": {
            "lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}}}).optimizer
    assert optimizer.type == "AdamW" and optimizer.params == {"lr": 1e-3, "weight_decay": 0.1}
    assert "adam_w_mode" in caplog.text
    l2 = Config.load({"optimizer": {"type": "adam", "params": {"weight_decay": 0.1,
                                                               "adam_w_mode": False}}}).optimizer
    assert l2.type == "Adam" and "adam_w_mode" not in l2.params


def test_deepspeed_cpu_adam_states_flag_is_taken():
    """DeepSpeed 0.19.8 pops optimizer.params.fp32_optimizer_states for Adam and AdamW (its
    CPU Adam's moments); zeromem's states take the masters' dtype, DeepSpeed's outcome."""
    for flag in (True, False):
        optimizer = Config.load({"optimizer": {"type": "AdamW", "params": {
            "lr": 1e-3, "fp32_optimizer_states": flag}}}).optimizer
        assert optimizer.params == {"lr": 1e-3, "weight_decay": 0.0}
    assert "fp32_optimizer_states" in load_error(
        {"optimizer": {"type": "Adam", "params": {"fp32_optimizer_states": "no"}}})


def test_adamw_defaults_to_deepspeed_weight_decay():
    optimizer = Config.load({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}).optimizer
    assert optimizer.params["weight_decay"] == 0.0
    assert "contradicts" in load_error(
        {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})


def test_scheduler_params_are_normalised():
    scheduler = Config.load({"scheduler": {"type": "warmupcosinelr", "params": {
        "total_num_steps": 1e4, "warmup_num_steps": 100.0}}}).scheduler
    assert scheduler.type == "WarmupCosineLR"
    assert scheduler.params == {"total_num_steps": 10_000, "warmup_num_steps": 100}


def test_config_pickles_with_its_provenance():
    config = Config.load({"zero_optimization": {"reduce_bucket_size": "auto"}}, hidden_size=16)
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and copy.describe() == config.describe()


def test_torch_autocast_runs_in_bfloat16_and_refuses_float16_or_no_dtype():
    config = Config.load({"torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}})
    assert config.torch_autocast.enabled and config.compute_dtype == torch.float32
    float16 = load_error({"torch_autocast": {"enabled": True, "dtype": "float16"}})
    assert "torch_autocast.dtype" in float16 and "fp16.enabled" in float16
    unset = load_error({"torch_autocast": {"enabled": True}})
    assert "torch_autocast" in unset and "bfloat16" in unset
    assert Config.load({"torch_autocast": {"enabled": False}}).torch_autocast.enabled is False
