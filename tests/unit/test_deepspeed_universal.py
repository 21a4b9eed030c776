"""DeepSpeed universal checkpoints (`ds_to_universal`), and the client state DeepSpeed
checkpoints carry, read without a process group.

Every case under tests/data/deepspeed_checkpoints holds DeepSpeed's checkpoint
(`global_step3`, `latest`) and, beside it, what DeepSpeed 0.19.8's `ds_to_universal`
made of it (`global_step3_universal`, `latest_universal`;
tools/make_deepspeed_checkpoints.py). The conversion only lays the same numbers out
per parameter, so reading either must give the same state, bit for bit; resuming
from it is tests/distributed/test_deepspeed_resume.py.
"""
from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

import numpy
import pytest
import torch

from models import PositionEmbeddingType
from setups import DEEPSPEED_CHECKPOINTS, Opens, deepspeed_case, inert
from zeromem.checkpoints.deepspeed_import import DeepSpeedState, import_deepspeed, read_deepspeed
from zeromem.checkpoints.deepspeed_pickles import ForeignObject, load_pt
from zeromem.checkpoints.tensor_files import CheckpointError

# DeepSpeed's ds_to_universal converts ZeRO checkpoints (stages 1-3) of Adam only
CASES = sorted(p.name for p in DEEPSPEED_CHECKPOINTS.iterdir()
               if (p / "expected.json").is_file() and (p / "latest_universal").is_file())


def same_state(a: DeepSpeedState, b: DeepSpeedState) -> None:
    assert a.params.keys() == b.params.keys()
    for name, states in a.params.items():
        assert states.keys() == b.params[name].keys(), name
        for kind, tensor in states.items():
            assert torch.equal(tensor, b.params[name][kind]), (name, kind)
    assert a.module_tensors.keys() == b.module_tensors.keys()
    assert all(torch.equal(t, b.module_tensors[k]) for k, t in a.module_tensors.items())
    assert repr(a.scalars) == repr(b.scalars)  # Adam's step, as tensors
    assert a.param_groups == b.param_groups and a.param_group == b.param_group
    assert (a.stage, a.world_size, a.state_dict_keys, a.aliases, a.loss_scaler) == \
        (b.stage, b.world_size, b.state_dict_keys, b.aliases, b.loss_scaler)


@pytest.mark.parametrize("name", CASES)
def test_universal_checkpoint_reads_as_the_checkpoint_it_was_made_from(name):
    path, expected = deepspeed_case(name)
    original = read_deepspeed(path)
    universal = read_deepspeed(path, universal=True)
    assert original.path.name == "global_step3"
    assert universal.path.name == "global_step3_universal"
    assert universal.stage == expected["stage"] and universal.world_size == expected["world_size"]
    same_state(original, universal)
    # a stage-3 universal checkpoint keeps no frozen parameters under zero/: they come from
    # the model states files, as in the checkpoint it was made from
    assert ("frozen.weight" in universal.module_tensors) != \
        bool(expected.get("exclude_frozen_parameters"))


def copy_case(tmp_path: Path, name: str = "stage2_ws2_fp32") -> Path:
    src, _ = deepspeed_case(name)
    shutil.copytree(src, tmp_path / name)
    return tmp_path / name


def test_the_pointer_file_read_follows_load_universal(tmp_path):
    """DeepSpeed reads `latest_universal` under checkpoint.load_universal, else `latest`;
    where only one is there, zeromem reads that one."""
    root = copy_case(tmp_path)
    assert read_deepspeed(root).path.name == "global_step3"
    assert read_deepspeed(root, universal=True).path.name == "global_step3_universal"
    (root / "latest").unlink()
    assert read_deepspeed(root).path.name == "global_step3_universal"
    (root / "latest").write_text("global_step3")
    (root / "latest_universal").unlink()
    assert read_deepspeed(root, universal=True).path.name == "global_step3"
    # the tag named, or its directory given, wins over either pointer
    assert read_deepspeed(root, "global_step3_universal").path.name == "global_step3_universal"
    assert read_deepspeed(root / "global_step3_universal").path.name == "global_step3_universal"
    out = Path(import_deepspeed(root, tmp_path / "out", "global_step3_universal"))
    assert out.name == "global_step3_universal" and (out / "manifest.json").is_file()


def universal_copy(tmp_path: Path, name: str = "stage2_ws2_fp32") -> Path:
    return copy_case(tmp_path, name) / "global_step3_universal"


def refused(tag: Path, match: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=match):
        import_deepspeed(tag.parent, tmp_path / "out", tag.name)
    assert not (tmp_path / "out" / "latest").exists()


def test_damaged_universal_checkpoints_are_refused_by_name(tmp_path):
    tag = universal_copy(tmp_path / "a")
    (tag / "zero" / "fc1.weight" / "exp_avg_sq.pt").unlink()
    refused(tag, r"fc1.weight holds the states \['exp_avg', 'master'\], but embed.weight's hold "
                 r"\['exp_avg', 'exp_avg_sq', 'master'\]", tmp_path)

    tag = universal_copy(tmp_path / "b", "stage3_ws2_fp32")
    shutil.rmtree(tag / "zero" / "fc2.bias")
    refused(tag, "no folder for parameter 'fc2.bias'", tmp_path)

    tag = universal_copy(tmp_path / "c")
    (tag / "zero" / "fc1.bias" / "fp32.pt").unlink()
    refused(tag, r"fc1.bias has no fp32.pt", tmp_path)

    tag = universal_copy(tmp_path / "d", "stage3_ws2_bf16")  # bare tensors at stage 3
    torch.save(torch.zeros(3), tag / "zero" / "fc1.weight" / "exp_avg.pt")
    refused(tag, r"exp_avg.pt holds a tensor of shape \[3\], where the model states give "
                 r"'fc1.weight' the shape \[7, 10\]", tmp_path)

    tag = universal_copy(tmp_path / "e")
    torch.save({"step": 3}, tag / "zero" / "embed.weight" / "step.pt")
    refused(tag, "step.pt holds a dict, not an optimizer step", tmp_path)

    tag = universal_copy(tmp_path / "f")
    file = tag / "zero" / "sometimes.weight" / "fp32.pt"
    file.write_bytes(file.read_bytes()[:100])
    refused(tag, "sometimes.weight/fp32.pt is not a readable torch checkpoint", tmp_path)

    tag = universal_copy(tmp_path / "g")
    (tag / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="universal checkpoint without its model states"):
        import_deepspeed(tag, tmp_path / "out")  # the tag's directory given as the checkpoint


def test_code_in_a_universal_checkpoint_is_never_run(tmp_path):
    tag = universal_copy(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"param": torch.zeros(7, 10), "cat_dim": Opens(marker)},
               tag / "zero" / "fc1.weight" / "exp_avg.pt")
    refused(tag, "could run code.*global io.open is not allowed", tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("universal", [False, True])
def test_client_state_comes_back_as_deepspeed_returns_it(universal):
    """Megatron-DeepSpeed's client state (argparse args holding an enum, every generator's
    state) loads: the args as inert stand-ins, numpy's state as arrays numpy takes back.
    DeepSpeed 0.19.8's load_checkpoint returned the same keys for this checkpoint."""
    path, expected = deepspeed_case("stage3_ws2_bf16_client_state")
    ds = read_deepspeed(path, universal=universal)
    client = ds.client_state()
    assert sorted(client) == ["args", "buffer_names", "checkpoint_parallel_dimensions",
                              "checkpoint_version", "ds_config", "ds_version",
                              "frozen_param_fragments", "frozen_param_shapes", "global_samples",
                              "iteration", "param_shapes", "rng_state", "shared_params", "tokens"]
    want = expected["client_state"]
    assert (client["iteration"], client["checkpoint_version"], client["tokens"]) == \
        (want["iteration"], want["checkpoint_version"], want["tokens"])
    args = client["args"]
    assert isinstance(args, ForeignObject) and args.global_name == "argparse.Namespace"
    assert args.consumed_train_samples == want["args.consumed_train_samples"]
    assert args.params_dtype == torch.bfloat16
    embedding = args.position_embedding_type  # models.PositionEmbeddingType.rotary, not built
    assert not isinstance(embedding, PositionEmbeddingType) and embedding.args == (2,)
    rng = client["rng_state"][0]  # what Megatron-DeepSpeed restores its generators from
    assert torch.is_tensor(rng["torch_rng_state"])
    kept = numpy.random.get_state()
    try:
        numpy.random.set_state(rng["np_rng_state"])  # a real array: numpy takes it back
        random.setstate(rng["random_rng_state"])
    finally:
        numpy.random.set_state(kept)
    assert rng["np_rng_state"][1].dtype == numpy.uint32 and rng["np_rng_state"][1].shape == (624,)
    same_state(read_deepspeed(deepspeed_case("stage3_ws2_bf16")[0], universal=universal), ds)


def test_foreign_objects_only_in_the_client_state(tmp_path):
    """In the client state an unknown object is a stand-in (nothing runs); in a key the
    import reads it is refused, naming the key."""
    tag = copy_case(tmp_path, "stage3_ws2_fp32") / "global_step3"
    marker = tmp_path / "ran"
    for rank in (0, 1):
        file = tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        model = load_pt(file, read=())
        model["mine"] = {"epoch": 2, "opener": Opens(marker)}
        torch.save(model, file)
    client = read_deepspeed(tag.parent).client_state()
    assert client["mine"]["epoch"] == 2 and not marker.exists()
    assert client["mine"]["opener"].args == (str(marker), "w")
    model["frozen_param_fragments"]["frozen.bias"] = Opens(marker)
    torch.save(model, tag / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="rank_1_mp_rank_00_model_states.pt holds objects "
                       "that could run code.*io.open is not allowed in 'frozen_param_fragments'"):
        read_deepspeed(tag.parent)
    assert not marker.exists()
    # optimizer files hold no client state: any object outside the allowlist is refused
    tag = copy_case(tmp_path / "optim", "stage2_ws2_fp32") / "global_step3"
    file = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim = load_pt(file, read=())
    optim["note"] = argparse.Namespace(epoch=2)
    torch.save(inert(optim), file)
    with pytest.raises(CheckpointError, match="rank_1_mp_rank_00_optim_states.pt holds objects "
                       "that could run code.*argparse.Namespace is not allowed"):
        read_deepspeed(tag.parent)


@pytest.mark.parametrize("universal", [False, True])
@pytest.mark.parametrize("name", ["stage2_ws2_fp32_two_groups", "stage3_ws2_fp32_two_groups"])
def test_param_groups_are_deepspeeds(name, universal):
    """HF Trainer's two param groups (weights decayed, biases not): each parameter lands in
    its group with its options. Stage 3 lists each group's sub-groups; a checkpoint whose
    groups and sub-groups disagree is refused."""
    path, expected = deepspeed_case(name)
    ds = read_deepspeed(path, universal=universal)
    assert len(ds.param_groups) == len(ds.scalars) == 2
    for want in expected["param_groups"]:
        for param in want["params"]:
            assert ds.param_groups[ds.param_group[param]]["weight_decay"] == want["weight_decay"]
    assert all(float(s["step"]) == expected["save_at"] for s in ds.scalars)


def test_stage3_sub_groups_that_no_param_group_holds_are_refused(tmp_path):
    tag = copy_case(tmp_path, "stage3_ws2_fp32_two_groups") / "global_step3"
    for rank in (0, 1):
        file = tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        optim = load_pt(file)
        optim["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][1]["params"] = []
        torch.save(inert(optim), file)
    with pytest.raises(CheckpointError, match=r"param groups hold the sub-groups \[0, 1\], but the "
                                              "model states list 3"):
        read_deepspeed(tag.parent)
