"""Record DeepSpeed's own run of DeepSpeed-Chat's pipeline (run by hand, not in CI).

Writes tests/data/deepspeed_chat/deepspeed_reference.json: what each stage of
tests/deepspeed_chat.py printed when started by DeepSpeed's `deepspeed` launcher,
with the versions that printed it; and deepspeed_models/: the SFT and reward models
it saved, from which DPO and PPO then start. test_deepspeed_chat.py runs the same commands with
`zeromem launch` and compares. Needs DeepSpeed (a test-data tool, never a zeromem
dependency) beside transformers, accelerate, datasets and tensorboard; on CPU:

    python3 -m venv .venv-ds && .venv-ds/bin/pip install torch==2.13.0 deepspeed \
        transformers accelerate datasets tensorboard
    DS_ACCELERATOR=cpu .venv-ds/bin/python tools/make_deepspeed_chat_reference.py
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import deepspeed_chat  # noqa: E402


def main() -> None:
    launcher = [str(Path(sys.executable).with_name("deepspeed"))]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    figures: dict[str, object] = {name: version(name) for name in
                                  ("deepspeed", "torch", "transformers", "accelerate")}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in deepspeed_chat.STAGES:
            done = deepspeed_chat.run(launcher, stage, Path(tmp), env)
            if done.returncode:
                raise SystemExit(f"{stage} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            figures[stage] = deepspeed_chat.read(stage, done.stdout)
            print(stage, figures[stage])
            if stage == "reward":  # the next stages start from DeepSpeed's models
                shutil.rmtree(deepspeed_chat.MODELS, ignore_errors=True)
                for model in ("actor", "critic"):
                    shutil.copytree(Path(tmp) / model, deepspeed_chat.MODELS / model)
    out = deepspeed_chat.CHAT / "deepspeed_reference.json"
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
