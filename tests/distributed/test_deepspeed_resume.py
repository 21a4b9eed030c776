"""Resuming DeepSpeed's own ZeRO checkpoints: the run continues DeepSpeed's loss curve.

The checkpoints under tests/data/deepspeed_checkpoints were saved by real DeepSpeed
(stages 1-3, 1 and 2 ranks, fp32 and bf16; tools/make_deepspeed_checkpoints.py), with
the losses DeepSpeed's run had on every micro-batch after the save. Each is loaded by
`engine.load_checkpoint` at 1 and 2 ranks and stages 1, 2 and 3, trained on the same
micro-batches, and its losses compared with DeepSpeed's on every rank.

Tolerances: fp32 1e-5 (measured: at most 5e-7, the order of summation across ranks);
bf16 2e-2 (measured: up to 8e-3 on losses near 2.6; zeromem and DeepSpeed round the
bf16 gradients' reductions differently across ranks and stages).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import zeromem
from harness import run_distributed
from models import TinyLM
from zeromem.checkpoints.tensor_files import CheckpointError
from setups import DEEPSPEED_CHECKPOINTS, deepspeed_case, deepspeed_curve, deepspeed_resume_config

CASES = sorted(p.name for p in DEEPSPEED_CHECKPOINTS.iterdir() if (p / "expected.json").is_file())
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def bad_directories(tmp: Path) -> dict[str, str]:
    """{directory: the error it must give}: a damaged DeepSpeed checkpoint, a foreign directory."""
    src, _ = deepspeed_case("stage2_ws2_fp32")
    damaged = tmp / "damaged"
    shutil.copytree(src, damaged)
    (damaged / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    foreign = tmp / "foreign"
    foreign.mkdir()
    (foreign / "pytorch_model.bin").write_bytes(b"")
    return {str(damaged): r"lacks the optimizer states of rank\(s\) \[1\]",
            str(foreign): "neither a zeromem checkpoint .* nor a DeepSpeed one.*pytorch_model.bin "
                          "looks like a weights file"}


def refuse(engine, bad: dict[str, str]) -> None:
    """Each bad directory raises its error on every rank and leaves the engine as it was."""
    before = [p.detach().clone() for p in engine.module.parameters()]
    steps = engine.global_steps
    for path, message in bad.items():
        with pytest.raises(CheckpointError, match=message):
            engine.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert engine.global_steps == steps


def resume_all(rank: int, world_size: int, bad: dict[str, str]) -> list[tuple[str, int, float]]:
    """(case, stage, worst loss difference) of every case resumed at every stage; then the
    bad directories are refused."""
    results = []
    for name in CASES:
        path, expected = deepspeed_case(name)
        gas = expected["micro_batches_per_step"] // world_size
        for stage in (1, 2, 3):
            torch.manual_seed(1 + rank)  # weights unlike DeepSpeed's: the checkpoint must set them
            engine = zeromem.initialize(TinyLM(), deepspeed_resume_config(expected, stage,
                                                                          world_size))
            loaded, client_state = engine.load_checkpoint(path)
            assert loaded == str(path / "global_step3") and client_state is None
            assert engine.global_steps == expected["save_at"]
            # DeepSpeed's WarmupLR at last_batch_iteration 2 gives its next step min + 2/5 (max - min)
            assert engine.get_lr() == pytest.approx([1e-3 + 0.4 * 9e-3])
            curve = deepspeed_curve(engine, rank, world_size, expected)
            mine = [want[rank * gas:(rank + 1) * gas] for want in expected["losses"]]
            worst = max(abs(a - b) for got, want in zip(curve, mine) for a, b in zip(got, want))
            results.append((name, stage, worst))
            assert worst <= TOLERANCE[expected["precision"]], (name, stage, rank, curve, mine)
            assert engine.global_steps == expected["save_at"] + len(expected["losses"])
    refuse(engine, bad)
    return results


def test_deepspeed_checkpoints_cover_stages_and_precisions():
    cases = [deepspeed_case(name)[1] for name in CASES]
    assert {c["stage"] for c in cases} == {1, 2, 3}
    assert {c["world_size"] for c in cases} == {1, 2}
    assert {c["precision"] for c in cases} == {"fp32", "bf16"}


def test_resume_deepspeed_checkpoint_one_rank(tmp_path):
    for name, stage, worst in resume_all(0, 1, bad_directories(tmp_path)):
        print(f"1 rank, {name} -> stage {stage}: max |loss - DeepSpeed's| = {worst:.1e}")


def test_resume_deepspeed_checkpoint_two_ranks(tmp_path):
    for rank_results in run_distributed(resume_all, 2, bad_directories(tmp_path)):
        for name, stage, worst in rank_results:
            print(f"2 ranks, {name} -> stage {stage}: max |loss - DeepSpeed's| = {worst:.1e}")
