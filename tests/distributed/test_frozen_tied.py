"""Checkpoints of a model whose tied weights nothing trains, and `zero_to_fp32`'s
`exclude_frozen_parameters` and `lazy_mode` on them.

A LoRA run over GPT-2, Llama 3.2 1B or Qwen2.5 0.5B freezes the embeddings, which the
head shares: one frozen tensor under two state_dict keys. Before stop 51 zeromem saved
such a checkpoint and then refused it as damaged at every stage ("'head.weight' is
neither a parameter, a module tensor nor an alias of a parameter").

TinyLM with its tied `embed` / `head` frozen (and its `frozen` layer): at stages 0-3 on 2
ranks a run saves after one step and takes a second; a model built from other weights,
its frozen ones scaled, loads the checkpoint at another stage and takes the same second
step. On every rank the resumed model's whole parameters equal the uninterrupted run's
(frozen ones exactly, trained ones within another stage's order of reduction).
Then DeepSpeed's `zero_to_fp32` calls on the checkpoints, as LoRA users convert theirs:
whole (the tie one tensor), without the frozen parameters (the adapters and buffers
only), lazily, and from the command line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import zeromem
from harness import run_distributed
from models import TinyLM
from setups import checkpoint_config, train_global_batch
from zeromem.checkpoints.tensor_files import CheckpointError
from zeromem.deepspeed.utils import zero_to_fp32

STAGES = (0, 1, 2, 3)
FROZEN = ["embed.weight", "frozen.weight", "frozen.bias"]  # head.weight is embed.weight


def lora_like(seed: int, frozen_scale: float = 1.0) -> TinyLM:
    """TinyLM from `seed`, with the 'pretrained' frozen weights every run shares (scaled)."""
    torch.manual_seed(123)
    pretrained = TinyLM().state_dict()
    torch.manual_seed(seed)
    model = TinyLM()
    with torch.no_grad():
        for key in FROZEN:
            model.get_parameter(key).copy_(pretrained[key] * frozen_scale)
    model.embed.requires_grad_(False)
    model.frozen.requires_grad_(False)
    return model


def whole_params(engine) -> dict[str, torch.Tensor]:
    """This rank's whole parameters, gathered where stage 3 shards them."""
    params = list(engine.module.parameters())
    with zeromem.GatheredParameters(params):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def save_and_resume(rank: int, world_size: int, root: Path) -> dict:
    diffs = {}
    for stage in STAGES:
        engine = zeromem.initialize(lora_like(0), checkpoint_config(stage, world_size))
        train_global_batch(engine, rank, world_size, range(1))
        engine.save_checkpoint(root / f"stage{stage}")
        train_global_batch(engine, rank, world_size, range(1, 2))
        want = whole_params(engine)
        other = zeromem.initialize(lora_like(1 + rank, frozen_scale=2.0),
                                   checkpoint_config(3 - stage, world_size))
        other.load_checkpoint(root / f"stage{stage}")
        train_global_batch(other, rank, world_size, range(1, 2))
        got = whole_params(other)
        assert got.keys() == want.keys()
        diffs[stage] = {k: (got[k] - want[k]).abs().max().item() for k in want}
    return diffs


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("frozen_tied")
    return root, run_distributed(save_and_resume, 2, root)


def test_frozen_tied_weights_save_and_resume_at_every_stage(saved):
    _, per_rank = saved
    for rank, diffs in enumerate(per_rank):
        for stage, by_key in diffs.items():
            # the frozen values exactly; the trained ones up to another stage's reduction order
            assert max(by_key[k] for k in FROZEN + ["head.weight"]) == 0.0, (rank, stage, by_key)
            assert max(by_key.values()) < 1e-6, (rank, stage, by_key)


def test_zero_to_fp32_reads_the_tie_as_one_frozen_tensor(saved):
    root, _ = saved
    keys = list(TinyLM().state_dict())
    for stage in STAGES:
        checkpoint = root / f"stage{stage}"
        tag = (checkpoint / "latest").read_text().strip()
        manifest = json.loads((checkpoint / tag / "manifest.json").read_text())
        assert manifest["frozen_parameters"] == FROZEN
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint)
        assert list(state) == keys and state["head.weight"] is state["embed.weight"]
        torch.testing.assert_close(state["embed.weight"], lora_like(0).embed.weight.detach(),
                                   rtol=0, atol=0)

        adapters = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
            checkpoint, exclude_frozen_parameters=True)
        assert list(adapters) == [k for k in keys if k not in FROZEN + ["head.weight"]]
        for key, value in adapters.items():
            torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)


def test_lazy_mode_reads_each_tensor_when_asked(saved):
    checkpoint = saved[0] / "stage3"
    eager = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint, lazy_mode=True)
    assert lazy.keys() == eager.keys() and lazy["head.weight"] is lazy["embed.weight"]
    for key, value in lazy.items():
        assert isinstance(value, zero_to_fp32.LazyTensor), key
        assert (value.shape, value.dtype) == (eager[key].shape, eager[key].dtype), key
        torch.testing.assert_close(value.contiguous(), eager[key], rtol=0, atol=0, msg=key)
    read = zero_to_fp32.to_torch_tensor(lazy)
    assert read["head.weight"] is read["embed.weight"]
    halves = zero_to_fp32.to_torch_tensor(lazy, dtype="bf16")
    empty = zero_to_fp32.to_torch_tensor(lazy, return_empty_tensor=True)
    for key, value in eager.items():
        torch.testing.assert_close(read[key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(halves[key], value.bfloat16(), rtol=0, atol=0, msg=key)
        assert (empty[key].shape, empty[key].dtype) == (value.shape, value.dtype), key
    adapters = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        checkpoint, exclude_frozen_parameters=True, lazy_mode=True)
    assert not set(adapters) & set(FROZEN + ["head.weight"])


def test_the_command_leaves_frozen_parameters_out(saved, tmp_path):
    checkpoint = saved[0] / "stage2"
    zero_to_fp32.main([str(checkpoint), str(tmp_path / "out"), "--exclude_frozen_parameters"])
    written = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    want = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        checkpoint, exclude_frozen_parameters=True)
    assert written.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(written[key], value, rtol=0, atol=0, msg=key)


def test_a_checkpoint_that_does_not_name_its_frozen_parameters_is_read_whole_only(saved, tmp_path):
    """Checkpoints written before stop 51 lack `frozen_parameters`: they still load and read
    whole, and the exclusion, which cannot tell frozen parameters from buffers, is refused."""
    old = tmp_path / "old"
    shutil.copytree(saved[0] / "stage1", old)
    manifest_file = next(old.glob("*/manifest.json"))
    manifest = json.loads(manifest_file.read_text())
    del manifest["frozen_parameters"]
    manifest_file.write_text(json.dumps(manifest))
    assert zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(old).keys() == \
        TinyLM().state_dict().keys()
    with pytest.raises(CheckpointError, match="cannot tell them from buffers"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(old, exclude_frozen_parameters=True)


def test_a_manifest_naming_a_trained_parameter_frozen_is_refused(saved, tmp_path):
    """The exclusion would drop it: the manifest is damaged, and said so by field."""
    damaged = tmp_path / "damaged"
    shutil.copytree(saved[0] / "stage3", damaged)
    manifest_file = next(damaged.glob("*/manifest.json"))
    manifest = json.loads(manifest_file.read_text())
    manifest["frozen_parameters"].append("fc1.weight")
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"frozen_parameters: \['fc1.weight'\] are not "
                                              "module_tensors"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(damaged)
