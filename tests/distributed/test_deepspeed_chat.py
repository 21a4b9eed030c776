"""DeepSpeed-Chat's three RLHF steps run unchanged under `zeromem launch` and print what
DeepSpeed prints.

The scripts are upstream's (tests/data/deepspeed_chat/, two lines patched for
transformers 5), started as DeepSpeed-Chat's training scripts start them with
`zeromem launch` in place of `deepspeed`. Each stage's printed losses, perplexities,
reward scores and DPO rewards are compared with DeepSpeed 0.19.8's own run of the same
commands (deepspeed_reference.json, made by tools/make_deepspeed_chat_reference.py).
The SFT and reward models saved (the SFT model by DeepSpeed-Chat's own
`save_zero_three_model` at ZeRO-3) must match DeepSpeed's. PPO runs with
`--enable_hybrid_engine`, as DeepSpeed-Chat's step-3 scripts do, and must print what
DeepSpeed prints without it: zeromem generates on the training engine either way.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import deepspeed_chat

pytest.importorskip("transformers")
pytest.importorskip("datasets")
REFERENCE = json.loads((deepspeed_chat.CHAT / "deepspeed_reference.json").read_text())
# bf16 throughout: figures printed in bf16 agree to a few of its units in the last place
# (at 0.3, 2^-9 = 0.002; at 0.7, 0.004), fp32 figures (SFT's losses, perplexity) to ~1e-3 of themselves
TOLERANCE = {"sft": (2e-3, 1e-3), "reward": (0, 0.012), "dpo": (0, 0.008), "ppo": (0, 0.008)}


def test_rlhf_pipeline_matches_deepspeed(tmp_path):
    launcher = [sys.executable, "-m", "zeromem.cli", "launch"]
    for stage in deepspeed_chat.STAGES:
        extra = ("--enable_hybrid_engine",) if stage == "ppo" else ()
        done = deepspeed_chat.run(launcher, stage, tmp_path, dict(os.environ), extra)
        assert done.returncode == 0, f"{stage}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        seen, expected = deepspeed_chat.read(stage, done.stdout), REFERENCE[stage]
        rel, abs_ = TOLERANCE[stage]
        for label, values in expected.items():
            assert len(seen[label]) == len(values) > 0, (stage, label, seen[label])
            assert seen[label] == pytest.approx(values, rel=rel, abs=abs_), (stage, label)
    for model in ("actor", "critic"):  # the models saved (stage 3: save_zero_three_model)
        ours = torch.load(tmp_path / model / "pytorch_model.bin", weights_only=True)
        theirs = torch.load(deepspeed_chat.MODELS / model / "pytorch_model.bin", weights_only=True)
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            torch.testing.assert_close(ours[key], value, rtol=0.02, atol=2e-3,
                                       msg=lambda m: f"{model} {key}: {m}")
