"""Importing DeepSpeed ZeRO checkpoints without a process group: states, CLI, bad directories.

The states are checked against fingerprints DeepSpeed's own API
(`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`) gave when the
checkpoints were made (tools/make_deepspeed_checkpoints.py); resuming them is
tests/distributed/test_deepspeed_resume.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from models import TinyLM
from setups import (DEEPSPEED_CHECKPOINTS, Opens, deepspeed_case, deepspeed_engine, deepspeed_scaler,
                    inert)
from zeromem.checkpoints.consolidate import consolidate, load_consolidated, resolve_checkpoint
from zeromem.checkpoints.deepspeed_import import (LoadingEngine, import_deepspeed, read_deepspeed,
                                                  write_imported)
from zeromem.checkpoints.deepspeed_pickles import load_pt
from zeromem.checkpoints.tensor_files import CheckpointError, SafetensorsReader
from zeromem.cli import main

CASES = sorted(p.name for p in DEEPSPEED_CHECKPOINTS.iterdir() if (p / "expected.json").is_file())


def fingerprint(t: torch.Tensor) -> dict:
    t = t.float().flatten()
    return {"sum": t.sum().item(), "sumsq": (t * t).sum().item(), "head": t[:4].tolist()}


@pytest.mark.parametrize("name", CASES)
def test_import_holds_deepspeeds_states(name, tmp_path):
    src, expected = deepspeed_case(name)
    # stage 0 numbers its states by position: the order the run gave its optimizer
    out = Path(write_imported(read_deepspeed(src, engine=deepspeed_engine(expected)), tmp_path))
    assert out == tmp_path / "global_step3" and (tmp_path / "latest").read_text() == "global_step3"
    with SafetensorsReader(out / "rank00000.safetensors") as reader:
        for param, states in expected["states"].items():
            if param == "__step__":
                continue
            for kind, want in states.items():
                key = f"master/{param}" if kind == "master" else f"optimizer/{kind}/{param}"
                got = fingerprint(reader.read(key))
                for field in ("sum", "sumsq"):
                    assert got[field] == pytest.approx(want[field], rel=1e-6, abs=1e-9), \
                        (param, kind, field)
                assert got["head"] == pytest.approx(want["head"], rel=1e-6, abs=1e-9)
    manifest = json.loads((out / "manifest.json").read_text())
    for param in manifest["params"].values():  # Adam's step, as a tensor like torch keeps it
        assert param["scalar_state"].get("step", {}).get("__tensor__") == \
            expected["states"].get("__step__")  # (SGD keeps none)
    assert manifest["counters"]["global_steps"] == expected["save_at"]
    excluded = expected["exclude_frozen_parameters"] if "exclude_frozen_parameters" in expected \
        else False
    # stages 0 and 1 never record frozen parameters apart: the module may lack them either way
    assert manifest["frozen_parameters_excluded"] == (excluded or expected["stage"] in (0, 1))
    # the module tensors that are not buffers (DeepSpeed's buffer_names): read whole, or left
    # out by zero_to_fp32's exclude_frozen_parameters
    tied = ["embed.weight"] if expected.get("frozen_tied") else []
    assert manifest["frozen_parameters"] == ([] if excluded else tied + ["frozen.weight", "frozen.bias"])
    assert manifest["scaler"] == deepspeed_scaler(expected)
    full = load_consolidated(consolidate(tmp_path, tmp_path / "full.pt"))
    torch.manual_seed(0)  # the seed DeepSpeed's run built TinyLM with: frozen weights never move
    frozen_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(expected["precision"],
                                                                      torch.float32)
    model = TinyLM().state_dict()
    frozen = ("frozen.", "embed.", "head.") if expected.get("frozen_tied") else ("frozen.",)
    for key, value in model.items():
        if key.startswith(frozen) and not excluded:
            assert torch.equal(full[key], value.to(frozen_dtype).float()), key
    if "embed.weight" in full:  # (a frozen one left out takes its tied head with it)
        assert torch.equal(full["head.weight"], full["embed.weight"])  # tied, stored once
    assert full.keys() == {k for k in model if not (excluded and k.startswith(frozen))}


def test_the_scripts_own_optimizer_is_told_from_its_options_without_an_engine(tmp_path):
    """Without an optimizer block DeepSpeed stepped the script's own optimizer (SGD here) and
    schedule: the import keeps its options and the schedule's saved state; its kind is the
    loading engine's, or, without one, told from torch's options."""
    src, expected = deepspeed_case("stage2_ws2_fp32_client_optimizer")
    manifest = json.loads((Path(import_deepspeed(src, tmp_path)) / "manifest.json").read_text())
    assert manifest["optimizer"]["type"] == "sgd"
    assert manifest["optimizer"]["tensor_states"] == ["momentum_buffer"]
    assert manifest["optimizer"]["param_groups"][0]["momentum"] == 0.9
    assert manifest["lr_scheduler"]["_last_lr"] == [expected["lrs"][0]]
    lion = read_deepspeed(src, engine=LoadingEngine([], "lion"))
    assert write_imported(lion, tmp_path / "lion") and json.loads(
        (tmp_path / "lion" / "global_step3" / "manifest.json").read_text())["optimizer"]["type"] == "lion"


def test_trainer_checkpoints_deepspeed_saved_keep_the_options_the_engine_holds(tmp_path):
    """HF Trainer checkpoints real DeepSpeed saved (tests/data/hf_deepspeed_checkpoints;
    resumed in test_hf_trainer.py): its CPU Adam keeps the config's betas as the JSON list
    it read, and an option (bias_correction) torch's Adam has not; HF's schedule adds one
    (initial_lr) DeepSpeed's optimizer, built from the config, has not."""
    hf = Path(__file__).parents[1] / "data" / "hf_deepspeed_checkpoints"

    def options(ds) -> dict:
        out = Path(write_imported(ds, tmp_path / ds.path.parent.parent.name))
        return json.loads((out / "manifest.json").read_text())["optimizer"]

    config_block = options(read_deepspeed(hf / "zero2" / "checkpoint-3"))
    assert config_block["param_groups"][0]["betas"] == {"__tuple__": [0.9, 0.999]}
    adam = frozenset(torch.optim.Adam([torch.zeros(1)]).param_groups[0]) - {"params"}
    engine = LoadingEngine([], "deepspeedcpuadam", adam | {"initial_lr"})  # HF's schedule's
    own = options(read_deepspeed(hf / "zero3_hf_optimizer" / "checkpoint-3", engine=engine))
    assert own["type"] == "deepspeedcpuadam"
    assert set(own["param_groups"][0]) == adam | {"initial_lr"}
    offline = options(read_deepspeed(hf / "zero3_hf_optimizer" / "checkpoint-3"))
    assert offline["type"] == "adamw" and "bias_correction" in offline["param_groups"][0]
    # DeepSpeed's AdamW under HF's schedule, which adds the lr it starts from to each group
    adamw = frozenset(torch.optim.AdamW([torch.zeros(1)]).param_groups[0]) - {"params"}
    engine = LoadingEngine([], "adamw", adamw | {"initial_lr"})
    scheduled = options(read_deepspeed(hf / "zero1_hf_schedule" / "checkpoint-3", engine=engine))
    assert set(scheduled["param_groups"][0]) == adamw | {"initial_lr"}


def test_cli_imports_and_reports_foreign_directories(tmp_path, capsys):
    src, _ = deepspeed_case("stage3_ws2_fp32")
    assert main(["import-deepspeed", str(src), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "global_step3" / "manifest.json").is_file()
    assert main(["import-deepspeed", str(src / "global_step3"), str(tmp_path / "out2")]) == 0
    assert main(["import-deepspeed", str(src), str(tmp_path / "out3"),
                 "--tag", "global_step3_universal"]) == 0  # its universal form
    assert (tmp_path / "out3" / "global_step3_universal" / "manifest.json").is_file()
    assert main(["import-deepspeed", str(tmp_path / "out"), str(tmp_path / "again")]) == 2
    assert "neither a zeromem checkpoint" not in capsys.readouterr().out
    assert main(["import-deepspeed", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_stage_0_checkpoint_is_read_without_an_engine_when_the_order_is_the_modules(tmp_path):
    """DeepSpeed's stage 0 (its default) keeps a torch optimizer's state in
    mp_rank_00_model_states.pt, numbered by position. Given `model.parameters()` (frozen
    ones too, which keep no state), the module's order is the optimizer's. A parameter
    with no state (no gradient yet: `sometimes` was skipped) is kept as a module tensor
    without an engine, and trained from zero states in one that trains it."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    tokens, targets = torch.randint(0, 10, (4, 8)), torch.randint(0, 10, (4, 8))
    model(tokens, targets, False).backward()
    optimizer.step()
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"module": model.state_dict(), "optimizer": optimizer.state_dict(),
                "ds_config": {"train_micro_batch_size_per_gpu": 4,
                              "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
                "buffer_names": [], "dp_world_size": 1, "mp_world_size": 1, "global_steps": 1},
               tag / "mp_rank_00_model_states.pt")
    (tmp_path / "ds" / "latest").write_text("global_step1")
    out = Path(import_deepspeed(tmp_path / "ds", tmp_path / "out"))
    manifest = json.loads((out / "manifest.json").read_text())
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert set(manifest["params"]) == trained and manifest["zero_stage"] == 0
    assert manifest["frozen_parameters"] == ["frozen.weight", "frozen.bias", "sometimes.weight",
                                             "sometimes.bias"]  # no state: taken for frozen
    assert manifest["aliases"] == {"head.weight": "embed.weight"}
    named = dict(model.named_parameters())
    with SafetensorsReader(out / "rank00000.safetensors") as reader:
        for name in trained:
            state = optimizer.state[named[name]]
            assert torch.equal(reader.read(f"master/{name}").view_as(named[name]), named[name])
            assert torch.equal(reader.read(f"optimizer/exp_avg/{name}").view_as(named[name]),
                               state["exp_avg"])
    order = [[(n, not n.startswith("frozen.")) for n, _ in model.named_parameters()]]
    read = read_deepspeed(tmp_path / "ds", engine=LoadingEngine(order, "adamw"))
    assert torch.equal(read.params["sometimes.weight"]["master"], model.sometimes.weight)
    assert not read.params["sometimes.weight"]["exp_avg_sq"].any()
    assert read.scalars == [{"step": torch.tensor(1.0)}]


def test_a_stage_0_checkpoint_in_another_order_is_refused_saying_how_to_load_it():
    """The run gave its optimizer the trained parameters only: the module's order is not
    the optimizer's, which only the script that saved it knows."""
    src, expected = deepspeed_case("stage0_ws2_fp32")
    with pytest.raises(CheckpointError, match=r"hold \[7\] parameters, the module's parameters "
                                              r"in one group \[9\].*engine.load_checkpoint.*"
                                              r"'module' state dict of mp_rank_00_model_states"):
        import_deepspeed(src, src.parent / "never")
    assert not (src.parent / "never").exists()
    weights = torch.load(src / "global_step3" / "mp_rank_00_model_states.pt",
                         weights_only=True)["module"]
    TinyLM().load_state_dict(weights)  # what the message tells the user to do works
    # given its order, its masters are DeepSpeed's (test_import_holds_deepspeeds_states)
    assert read_deepspeed(src, engine=deepspeed_engine(expected)).stage == 0


def test_foreign_directories_say_what_they_look_like(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="Hugging Face model directory"):
        import_deepspeed(hf, tmp_path / "out")
    with pytest.raises(CheckpointError, match="Hugging Face model directory.*from_pretrained"):
        resolve_checkpoint(hf)  # zeromem's loader says the same
    with pytest.raises(CheckpointError, match="neither a zeromem checkpoint.*it is empty"):
        resolve_checkpoint(empty)
    (empty / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="DeepSpeed one.*it holds notes.txt"):
        import_deepspeed(empty, tmp_path / "out")
    dcp = tmp_path / "step-1000"  # what torch.distributed.checkpoint.save writes
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    (dcp / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="DCP.*engine.load_checkpoint reads it"):
        resolve_checkpoint(dcp)  # zeromem consolidate reads zeromem checkpoints only
    with pytest.raises(CheckpointError, match=r"holds DCP checkpoints \(step-1000/\): pass one"):
        resolve_checkpoint(tmp_path)  # torchtitan's checkpoint folder, no tag


def damaged_copy(tmp_path: Path, name: str = "stage2_ws2_fp32") -> Path:
    src, _ = deepspeed_case(name)
    copy = tmp_path / name
    shutil.copytree(src, copy)
    return copy / "global_step3"


def test_damaged_deepspeed_checkpoints_are_refused_by_name(tmp_path):
    tag = damaged_copy(tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks the optimizer states of rank\(s\) \[1\]"):
        import_deepspeed(tag.parent, tmp_path / "out")

    tag = damaged_copy(tmp_path / "t")
    file = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    file.write_bytes(file.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match="zero_pp_rank_0.*not a readable torch checkpoint"):
        import_deepspeed(tag.parent, tmp_path / "out")

    tag = damaged_copy(tmp_path / "s")  # model states listing a parameter the partitions lack
    model = load_pt(tag / "mp_rank_00_model_states.pt")
    model["param_shapes"][0]["extra.weight"] = torch.Size([5])
    torch.save(model, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="fewer than the parameters.*'extra.weight'"):
        import_deepspeed(tag.parent, tmp_path / "out")
    assert not (tmp_path / "out" / "latest").exists()


def test_damaged_zero_infinity_swap_files_are_refused_by_name(tmp_path):
    """DeepSpeed's NVMe-offloaded sub-groups live in offloaded_tensors/rank{NN}/ (their
    partitions empty in the optimizer files): a truncated, missing or extra file is named."""
    name = "stage3_ws2_fp32_nvme"
    tag = damaged_copy(tmp_path / "t", name)
    state = tag / "offloaded_tensors" / "rank01" / "exp_avg_sq-0_5.tensor.swp"
    state.write_bytes(state.read_bytes()[:4096])
    with pytest.raises(CheckpointError, match=r"rank01/exp_avg_sq-0_5.tensor.swp holds 4096 "
                                              "bytes where 262565 torch.float32 values.*truncated"):
        import_deepspeed(tag.parent, tmp_path / "out")

    tag = damaged_copy(tmp_path / "m", name)
    shutil.rmtree(tag / "offloaded_tensors" / "rank00")
    with pytest.raises(CheckpointError, match=r"offloaded_tensors/rank00 is missing"):
        import_deepspeed(tag.parent, tmp_path / "out")

    tag = damaged_copy(tmp_path / "x", name)  # a stray file: two swapped, one left empty
    shutil.copy(tag / "offloaded_tensors" / "rank01" / "0_5.tensor.swp",
                tag / "offloaded_tensors" / "rank01" / "6_8.tensor.swp")
    with pytest.raises(CheckpointError, match=r"rank01: 2 swapped sub-group\(s\) for the 1"):
        import_deepspeed(tag.parent, tmp_path / "out")
    assert not (tmp_path / "out" / "latest").exists()


def test_fp16_checkpoint_without_its_loss_scaler_is_refused(tmp_path):
    tag = damaged_copy(tmp_path, "stage2_ws2_fp16")
    for rank in (0, 1):
        file = tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        optim = load_pt(file)
        del optim["optimizer_state_dict"]["loss_scaler"]
        torch.save(inert(optim), file)
    with pytest.raises(CheckpointError, match="fp16 loss scaler has no number 'cur_scale'"):
        import_deepspeed(tag.parent, tmp_path / "out")
    assert not (tmp_path / "out" / "latest").exists()


def test_code_in_a_deepspeed_checkpoint_is_never_run(tmp_path):
    tag = damaged_copy(tmp_path, "stage3_ws2_fp32")
    marker = tmp_path / "ran"
    file = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model = load_pt(file)
    model["lr_scheduler"] = Opens(marker)
    torch.save(model, file)
    with pytest.raises(CheckpointError, match="could run code.*global io.open is not allowed"):
        import_deepspeed(tag.parent, tmp_path / "out")
    assert not marker.exists()
