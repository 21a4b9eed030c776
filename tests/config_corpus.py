"""Classify the real DeepSpeed configs of tests/data/ds_config_corpus: loads, refused, other.

    python tests/config_corpus.py          # the table and the counts

A config *loads* when `Config.load` and `check_supported_keys` accept it (what
`zeromem.initialize` checks before it touches the model); it is *refused* when they
raise `Unsupported`, which names the key, the DeepSpeed feature and why; anything else
(an unknown key, a value zeromem cannot derive) is *other*.

A config with Hugging Face's "auto" values is meant for the HF Trainer or Accelerate,
which fill them before DeepSpeed (or zeromem) sees the config: it is classified as HF's
own filler (`HfTrainerDeepSpeedConfig`, run in a subprocess under
`install_as_deepspeed()`) leaves it, with the TrainingArguments a user of that config
would pass (its own batch sizes, accumulation and fp16/bf16 switch), and the keys
Accelerate's `DeepSpeedPlugin` fills as the Trainer builds it (e.g.
`stage3_gather_16bit_weights_on_model_save`). Without transformers and accelerate such
configs are classified as given.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "data" / "ds_config_corpus"
# the folders of the configs fine-tuning frameworks ship for HF's Trainer
# (tests/distributed/test_hf_trainer.py trains with those that load), and those that do
# not: AutoTP (refused: zeromem does not shard layers itself) and LLaMA-Factory's fp8
# example (two top-level keys DeepSpeed does not have)
FRAMEWORKS = ("axolotl", "LLaMA-Factory", "LLaVA", "ms-swift", "FastChat", "InternVL")
FRAMEWORKS_NOT_LOADING = {"LLaMA-Factory/examples/deepspeed/ds_z2_autotp_config.json": "refused",
                          "LLaMA-Factory/examples/deepspeed/ds_z3_fp8_config.json": "other"}

FILL = r"""
import json, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import zeromem.deepspeed
zeromem.deepspeed.install_as_deepspeed()
from accelerate.utils import DeepSpeedPlugin
from transformers import TrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

class Model:  # what trainer_config_finalize reads from the model
    class config:
        hidden_size = 64

def number(value, default):
    return value if isinstance(value, int) and not isinstance(value, bool) else default

def on(block):
    return isinstance(block, dict) and block.get("enabled") is True

out = {}
for path in sys.argv[1:]:
    data = json.load(open(path))
    gas = number(data.get("gradient_accumulation_steps"), 1)
    micro = number(data.get("train_micro_batch_size_per_gpu"),
                   number(data.get("train_batch_size"), 8 * gas) // gas)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[])
    # the user's arguments, set after construction: fp16 checks for a GPU there
    args.per_device_train_batch_size, args.gradient_accumulation_steps = micro, gas
    args.fp16 = on(data.get("fp16"))
    args.bf16 = on(data.get("bf16", data.get("bfloat16")))
    try:
        hf = HfTrainerDeepSpeedConfig(data)
        hf.trainer_config_process(args)
        if "zero_optimization" in hf.config:  # Accelerate's plugin requires the block
            DeepSpeedPlugin(hf_ds_config=hf)  # as the Trainer builds it: fills its own keys
        hf.trainer_config_finalize(args, Model, 100)
        out[path] = {"config": hf.config}
    except Exception as error:
        out[path] = {"error": f"{type(error).__name__}: {error}"}
print(json.dumps(out))
"""


def corpus_files() -> list[Path]:
    return sorted(CORPUS.rglob("*.json"))


def framework_files() -> list[Path]:
    return [path for path in corpus_files() if path.relative_to(CORPUS).parts[0] in FRAMEWORKS]


def _has_auto(value) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    return value == "auto"


def hf_filled(paths: list[Path]) -> dict[Path, dict]:
    """{path: {"config": filled dict} or {"error": why HF refused it}} for configs with "auto"."""
    auto = [p for p in paths if _has_auto(json.loads(p.read_text()))]
    if not auto:
        return {}
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return {}
    import zeromem  # the child imports the same zeromem (a mutant's copy under tools/mutants.py)
    src = str(Path(zeromem.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", FILL, *map(str, auto)], capture_output=True,
                         text=True, env=env, timeout=300)
    if run.returncode:
        raise RuntimeError(f"filling the HF configs failed:\n{run.stderr[-3000:]}")
    return {Path(k): v for k, v in json.loads(run.stdout.splitlines()[-1]).items()}


def classify(source) -> tuple[str, str]:
    """("loads" | "refused" | "other", detail) of one config (a path or a dict)."""
    from zeromem.config import schema
    from zeromem.config.support import check_supported_keys

    unsupported = getattr(schema, "Unsupported", None)  # absent before this classification
    logging.disable(logging.WARNING)
    try:
        check_supported_keys(schema.Config.load(source))
        return "loads", ""
    except schema.ConfigError as error:
        text = str(error).replace(f"{source}: ", "")
        if unsupported is not None:
            refused = isinstance(error, unsupported)
        else:  # the wording of the refusals that existed before `Unsupported`
            refused = "is not supported" in text
        return ("refused" if refused else "other"), text
    finally:
        logging.disable(logging.NOTSET)


def classify_corpus() -> dict[str, tuple[str, str]]:
    """{path relative to the corpus: (kind, detail)} for every config of the corpus."""
    paths = corpus_files()
    filled = hf_filled(paths)
    out = {}
    for path in paths:
        name = str(path.relative_to(CORPUS))
        if path in filled and "error" in filled[path]:
            out[name] = ("other", "HF's filler refused it: " + filled[path]["error"])
        else:
            out[name] = classify(filled[path]["config"] if path in filled else path)
    return out


def main() -> None:
    results = classify_corpus()
    counts: dict[str, int] = {}
    for name, (kind, detail) in results.items():
        counts[kind] = counts.get(kind, 0) + 1
        print(f"{kind:<8} {name}\n         {detail[:200]}" if detail else f"{kind:<8} {name}")
    print(f"\n{len(results)} configs: " + ", ".join(f"{counts.get(k, 0)} {k}"
                                                for k in ("loads", "refused", "other")))


if __name__ == "__main__":
    main()
