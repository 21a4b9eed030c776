"""Checkpoints saved with `exclude_frozen_parameters=True` (issue 13, item 4).

A user who freezes a layer (TinyLM's `frozen`, as one would freeze pretrained
embeddings) saves without it and resumes with the model's own copy: at stages 0-3 on
2 ranks, each checkpoint resumed at another stage on 2 ranks (and those of stages 1 and
3 at their own stage on 1 rank), and the resumed runs end where the uninterrupted run
ended. The files hold no frozen tensor; a load keeps the loading model's frozen values
(even when they differ from the saver's); a load that would leave a trained parameter
unset is refused naming it, and so is a checkpoint not marked as saved without frozen
parameters that lacks them. `zeromem.deepspeed`'s engine takes DeepSpeed's keywords
for the same.

One spawned world of 2 ranks; the 1-rank cases run in this process.
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
from zeromem.checkpoints.consolidate import SafetensorsReader
from zeromem.checkpoints.tensor_files import CheckpointError

STAGES = (0, 1, 2, 3)
SAVE_AT, RESUME = 1, 1  # optimizer steps before the save, and after the load


def frozen_layer(scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The frozen layer's weights every run starts from (like pretrained embeddings)."""
    torch.manual_seed(123)
    return {k: v * scale for k, v in TinyLM().frozen.state_dict().items()}


def build(stage: int, world_size: int, seed: int, frozen: dict, trainable_frozen=False):
    torch.manual_seed(seed)
    model = TinyLM()
    model.frozen.load_state_dict(frozen)
    model.frozen.requires_grad_(trainable_frozen)
    return zeromem.initialize(model, checkpoint_config(stage, world_size))


def plain(state: dict[str, torch.Tensor]) -> dict:
    """A state dict that crosses process boundaries by value (numpy), not shared memory."""
    return {k: v.numpy() for k, v in state.items()}


def save_runs(rank: int, world_size: int, root: Path) -> dict:
    """Per stage: a run saved without frozen parameters after SAVE_AT steps; its full state
    dict at the save and after RESUME more steps (rank 0)."""
    out = {}
    for stage in STAGES:
        engine = build(stage, world_size, 0, frozen_layer())
        train_global_batch(engine, rank, world_size, range(SAVE_AT))
        engine.save_checkpoint(root / f"stage{stage}", exclude_frozen_parameters=True)
        at_save = plain(engine.full_state_dict())
        train_global_batch(engine, rank, world_size, range(SAVE_AT, SAVE_AT + RESUME))
        out[stage] = (at_save, plain(engine.full_state_dict()))
    return out


def resume_runs(rank: int, world_size: int, root: Path, pairs) -> dict:
    """(saved stage, loading stage) -> full state dict after RESUME steps (rank 0); the
    loading model's trained weights differ from the saver's, its frozen layer does not."""
    out = {}
    for saved, stage in pairs:
        engine = build(stage, world_size, 1 + rank, frozen_layer())
        engine.load_checkpoint(root / f"stage{saved}")
        train_global_batch(engine, rank, world_size, range(SAVE_AT, SAVE_AT + RESUME))
        out[(saved, stage)] = plain(engine.full_state_dict())
    return out


def deepspeed_keywords(rank: int, world_size: int, root: Path) -> None:
    """DeepSpeed's save_checkpoint(exclude_frozen_parameters=True) and the
    load_checkpoint(load_module_strict=False) its users pair it with."""
    import zeromem.deepspeed as deepspeed

    torch.manual_seed(0)
    model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, config=checkpoint_config(2, world_size))
    train_global_batch(engine, rank, world_size, range(1))
    assert engine.save_checkpoint(root / "ds", exclude_frozen_parameters=True)
    manifest = json.loads((root / "ds" / "global_step1" / "manifest.json").read_text())
    assert manifest["frozen_parameters_excluded"] and "frozen.weight" not in manifest["state_dict_keys"]
    trained = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("frozen")}
    train_global_batch(engine, rank, world_size, range(1, 2))
    engine.load_checkpoint(root / "ds", load_module_strict=False)
    for key, value in model.state_dict().items():
        if key in trained:
            torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
    weights = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert engine.save_16bit_model(root, "m16.bin", exclude_frozen_parameters=True)
    if rank == 0:
        assert weights.keys() == trained.keys()
        assert torch.load(root / "m16.bin").keys() == trained.keys()


def two_ranks(rank: int, world_size: int, root: Path) -> tuple:
    saved = save_runs(rank, world_size, root)
    resumed = resume_runs(rank, world_size, root, [(s, 3 - s) for s in STAGES])
    deepspeed_keywords(rank, world_size, root)
    return saved, resumed


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(torch.from_numpy(got[key]), torch.from_numpy(want[key]),
                                   rtol=0, atol=1e-6, msg=f"{what}: {key}")


def assert_no_frozen_tensors(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["frozen_parameters_excluded"] is True
    listed = list(manifest["module_tensors"]) + manifest["state_dict_keys"] + list(manifest["params"])
    assert not [k for k in listed if k.startswith("frozen.")], listed
    for file in checkpoint.glob("rank*.safetensors"):
        reader = SafetensorsReader(file)
        try:
            assert not [k for k in reader.keys() if "frozen." in k], file
        finally:
            reader.close()


def refusals(root: Path) -> None:
    """Loads that would leave a trained parameter, or an unmarked frozen one, unset."""
    engine = build(1, 1, 5, frozen_layer(), trainable_frozen=True)
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(CheckpointError, match=r"saved without frozen parameters and lacks "
                                              r"\[.*'frozen.weight'.*which this model trains"):
        engine.load_checkpoint(root / "stage1")
    unmarked = root / "unmarked"
    shutil.copytree(root / "stage1", unmarked)
    manifest_file = unmarked / f"global_step{SAVE_AT}" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["frozen_parameters_excluded"] = False
    manifest_file.write_text(json.dumps(manifest))
    engine = build(1, 1, 5, frozen_layer())
    with pytest.raises(CheckpointError, match=r"frozen parameter 'frozen.weight' is not in it"):
        engine.load_checkpoint(unmarked)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_exclude_frozen_parameters_save_and_resume(tmp_path):
    saved, resumed = run_distributed(two_ranks, 2, tmp_path)[0]
    for stage in STAGES:
        assert_no_frozen_tensors(tmp_path / f"stage{stage}" / f"global_step{SAVE_AT}")
        final = saved[stage][1]
        assert_same(resumed[(stage, 3 - stage)], final, f"stage {stage} -> {3 - stage}, 2 ranks")
        if stage in (1, 3):  # 1 rank: the stages whose checkpoints are sharded
            ones = resume_runs(0, 1, tmp_path, [(stage, stage)])[(stage, stage)]
            assert_same(ones, final, f"stage {stage} on 2 ranks -> 1 rank")
    # the loading model's own frozen values stay, even unlike the saver's; the rest is loaded
    engine = build(2, 1, 7, frozen_layer(scale=2.0))
    engine.load_checkpoint(tmp_path / "stage2")
    at_save = saved[2][0]
    for key, value in engine.full_state_dict().items():
        want = frozen_layer(2.0)[key.removeprefix("frozen.")] if key.startswith("frozen.") \
            else torch.from_numpy(at_save[key])
        torch.testing.assert_close(value, want, rtol=0, atol=0, msg=key)
    refusals(tmp_path)
