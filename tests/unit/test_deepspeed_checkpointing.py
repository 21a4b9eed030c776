"""`deepspeed.checkpointing.configure` under DeepSpeed's signature, as Megatron-DeepSpeed and
Lightning's DeepSpeedStrategy call it: `mpu_` first, DeepSpeed's argument names, the
policy from the defaults, then the config's `activation_checkpointing` block, then every
argument that is not None. The model-parallel group from Megatron's `mpu_`:
tests/distributed/test_deepspeed_api.py."""
from __future__ import annotations

import json

import pytest

import zeromem.checkpointing
from zeromem.deepspeed import checkpointing
from zeromem.config.schema import ConfigError

BLOCK = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                      "profile": True}}


@pytest.fixture(autouse=True)
def default_policy_afterwards():
    yield
    zeromem.checkpointing.configure()  # the process-wide default, as other tests expect it


def test_lightnings_call_sets_each_named_field():
    policy = checkpointing.configure(mpu_=None, partition_activations=False,
                                     contiguous_checkpointing=None, checkpoint_in_cpu=True,
                                     profile=None)
    assert policy == zeromem.checkpointing.get_config()
    assert (policy.partition_activations, policy.cpu_checkpointing, policy.profile,
            policy.contiguous_memory_optimization, policy.mp_group) == (False, True, False, False, None)


def test_a_config_file_then_the_arguments_over_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, **BLOCK}))
    policy = checkpointing.configure(None, deepspeed_config=str(path), profile=False,
                                     num_checkpoints=4, contiguous_checkpointing=True,
                                     synchronize=True)
    assert (policy.partition_activations, policy.cpu_checkpointing, policy.profile,
            policy.contiguous_memory_optimization, policy.number_checkpoints,
            policy.synchronize_checkpoint_boundary) == (True, True, False, True, 4, True)
    # from a dict, every other field back at its default: a new configure starts afresh
    policy = checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {}})
    assert policy == type(policy)()


def test_a_misspelt_key_in_the_block_is_named():
    with pytest.raises(ConfigError, match="partition_activation"):
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing":
                                                        {"partition_activation": True}})
