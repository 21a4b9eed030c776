"""DeepSpeedExamples' own training scripts run on `zeromem.deepspeed` (issue 13, item 1).

The scripts under tests/data/deepspeed_examples/ are upstream's, imports
included (see the README there). Each is started as upstream's run scripts start
it, by DeepSpeed's launcher flags (`zeromem launch`, which passes --local_rank and
answers `import deepspeed` with zeromem), at ZeRO stages 0-3 on 2 gloo ranks and
once as a single process with the same global batch; the per-step losses (mean
over ranks, from the ZEROMEM_LOSS_LOG hook) must agree, and for HelloDeepSpeed so
must the fp32 weights it checkpoints.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from harness import free_port
from zeromem.checkpoints.consolidate import consolidate

EXAMPLES = Path(__file__).parents[1] / "data" / "deepspeed_examples"
SRC = Path(__file__).parents[2] / "src"
pytest.importorskip("transformers")


def _launch(tmp: Path, name: str, nproc: int, script: str, offline: str, args: list[str],
            seed: bool = False, launcher_flags: tuple[str, ...] = ()) -> list[float]:
    """Run `script` on `nproc` ranks as upstream's run script does with DeepSpeed's
    launcher (`deepspeed [launcher_flags] script ...`), here `zeromem launch`; the mean
    over ranks of each backward's loss."""
    log = tmp / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", ZEROMEM_LOSS_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(EXAMPLES / "offline" / offline), str(SRC)]))
    if seed:
        env["ZEROMEM_EXAMPLE_SEED"] = "0"
    cmd = [sys.executable, "-m", "zeromem.cli", "launch", f"--num_gpus={nproc}",
           *launcher_flags, f"--master_port={free_port()}", str(EXAMPLES / script), *args]
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    per_step: dict[int, list[float]] = defaultdict(list)
    for line in log.read_text().splitlines():
        _, step, loss = line.split()
        per_step[int(step)].append(float(loss))
    assert all(len(v) == nproc for v in per_step.values()), per_step
    return [sum(v) / nproc for _, v in sorted(per_step.items())]


def test_cifar10_example_matches_one_process(tmp_path):
    """cifar10_deepspeed.py: 16 samples a step over 2 ranks = 16 on one, at every stage."""
    args = ["--dtype", "fp32", "-e", "2", "--log-interval", "2", "--deepspeed"]
    run_ds = ("--bind_cores_to_rank",)  # training/cifar/run_ds.sh
    ref = _launch(tmp_path, "one", 1, "cifar10_deepspeed.py", "cifar", args + ["--stage", "0"],
                  seed=True, launcher_flags=run_ds)
    assert len(ref) == 8  # 64 synthetic samples, 2 epochs, global batch 16
    for stage in (0, 2, 3):  # stage 1: train_bert_ds.py below (each example spares one)
        got = _launch(tmp_path, f"s{stage}", 2, "cifar10_deepspeed.py", "cifar",
                      args + ["--stage", str(stage)], seed=True, launcher_flags=run_ds)
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-6), f"stage {stage}"


def _bert(tmp: Path, name: str, nproc: int, stage: int) -> tuple[list[float], dict]:
    ckpt = tmp / name
    args = ["--checkpoint_dir", str(ckpt), "--tokenizer", str(EXAMPLES / "tokenizer"),
            "--num_layers", "2", "--num_heads", "2", "--ff_dim", "64", "--h_dim", "32",
            "--max_seq_length", "32", "--batch_size", "4", "--num_iterations", "6",
            "--log_every", "2", "--dtype", "bf16", "--zero_stage", str(stage)]
    losses = _launch(tmp, name, nproc, "train_bert_ds.py", "bert", args)
    (exp_dir,) = ckpt.iterdir()
    out = tmp / f"{name}.pt"
    consolidate(exp_dir, out)
    return losses, torch.load(out)


def test_hello_deepspeed_example_matches_one_process(tmp_path):
    """train_bert_ds.py: every rank draws the same seeded batches, so 2 ranks of 4 = 1 of 4."""
    ref_losses, ref_weights = _bert(tmp_path, "one", 1, 1)
    assert len(ref_losses) == 5
    for stage in (1, 2, 3):  # stage 0: cifar10_deepspeed.py above
        losses, weights = _bert(tmp_path, f"s{stage}", 2, stage)
        assert losses == pytest.approx(ref_losses, abs=1e-6), f"stage {stage}"
        assert weights.keys() == ref_weights.keys()
        for key, value in ref_weights.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {stage} {key}: {m}")
