"""`zeromem bench` (planning/bench.py): one model under DDP, FSDP2 and zeromem side by side.

Timings are never asserted (they live in the benchmarks). What is: every system trains
the same model from the same weights on the same batches with the config's optimizer,
clipping, scheduler and accumulation, so in fp32 their losses agree at the first step and
after training; each stage asked for is the stage run; a system the command does not
know, or zero timed steps, is refused by name; a system that fails is reported with its error while the others
run; the table says which systems were skipped.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from zeromem import cli
from zeromem.config.rules import ConfigError
from zeromem.planning.bench import Bench, Result, _Inputs, resolved_config, table
from zeromem.planning.model_shapes import load_hf_model, model_dims, shape_of

TESTS = Path(__file__).resolve().parent.parent
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3,
                                                       "warmup_max_lr": 0.02}},
          "zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 0}}
SYSTEMS = ("ddp", "fsdp2", "zeromem", "zeromem-3")
WARMUP, STEPS = 1, 3


@pytest.fixture(scope="module")
def benched(tmp_path_factory) -> dict:
    config = tmp_path_factory.mktemp("bench") / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    # TinyLM: a tied head, a frozen layer, odd sizes (padding); 5 tokens a sequence
    args = ["bench", f"{TESTS / 'models.py'}:TinyLM", "--config", str(config), "--reps", "1",
            "--warmup", str(WARMUP), "--steps", str(STEPS), "--seq", "5", "--json",
            "--systems", ",".join(SYSTEMS)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(args) == 0
    return json.loads(printed.getvalue())


def test_every_system_trains_the_same_model_on_the_same_batches(benched):
    systems = benched["systems"]
    assert list(systems) == list(SYSTEMS)
    losses = {name: r["losses"] for name, r in systems.items()}
    for name, got in losses.items():
        assert len(got) == WARMUP + STEPS and len(systems[name]["seconds"]) == STEPS, name
        assert got[0] == pytest.approx(losses["ddp"][0], abs=1e-6), name  # same weights, batch
        assert got[-1] == pytest.approx(losses["ddp"][-1], abs=1e-5), name  # same training
    assert abs(losses["ddp"][-1] - losses["ddp"][0]) > 1e-2  # it trained



def test_ddp_trains_with_muon_as_zeromem_does_and_fsdp2_is_skipped(tmp_path, capsys):
    """The config's Muon steps the matrices (use_muon) and Adam the rest; the DDP baseline
    gave every parameter to Adam, so its losses differed from zeromem's at the second step.
    FSDP2 shards each matrix, which Muon steps whole: skipped, and the table says why."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization":
                                  {"stage": 2}, "optimizer": {"type": "Muon",
                                                              "params": {"lr": 0.05}}}))
    assert cli.main(["bench", f"{TESTS / 'models.py'}:TinyLM", "--config", str(config),
                     "--systems", "ddp,fsdp2,zeromem", "--reps", "1", "--warmup", "0",
                     "--steps", "3", "--seq", "5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert list(got["systems"]) == ["ddp", "zeromem"] and "Muon" in got["skipped"]["fsdp2"]
    ddp, zero = (got["systems"][s]["losses"] for s in ("ddp", "zeromem"))
    assert zero == pytest.approx(ddp, abs=1e-5) and abs(ddp[-1] - ddp[0]) > 1e-2

def test_each_system_runs_the_stage_it_names(benched):
    stages = {name: r["stage"] for name, r in benched["systems"].items()}
    assert stages == {"ddp": None, "fsdp2": None, "zeromem": 2, "zeromem-3": 3}


def test_bad_input_is_refused_by_name_and_skipped_systems_are_said(tmp_path, capsys):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    model = f"{TESTS / 'models.py'}:TinyLM"
    for bad in ("zeromem-4", "fsdp2-3", "megatron", "zeromem-"):
        assert cli.main(["bench", model, "--config", str(config), "--systems", f"ddp,{bad}"]) == 2
        assert repr(bad) in capsys.readouterr().err
    assert cli.main(["bench", model, "--config", str(config), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    if importlib.util.find_spec("deepspeed") is None:  # nothing left to run: said, not a crash
        assert cli.main(["bench", model, "--config", str(config), "--systems", "deepspeed"]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == \
            "skipped deepspeed: deepspeed is not installed"


def test_a_system_that_fails_is_reported_beside_the_others_and_the_run_exits_1(tmp_path, capsys):
    """Without an optimizer DDP has nothing to step and zeromem's engine evaluates only: both
    fail in their ranks; the run goes on, names each one's error and exits 1."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    assert cli.main(["bench", f"{TESTS / 'models.py'}:TinyLM", "--config", str(config),
                     "--systems", "ddp,zeromem", "--reps", "2", "--warmup", "0", "--steps", "1",
                     "--seq", "5"]) == 1
    out = capsys.readouterr()
    rows = out.out.splitlines()[1:]
    assert rows[0].startswith("ddp") and "failed: ValueError: the config names no optimizer" in rows[0]
    assert rows[1].startswith("zeromem") and "failed: RuntimeError: backward(): this engine was " \
        "given no optimizer" in rows[1]
    tried = [line for line in out.err.splitlines() if line.startswith("rep ")]
    assert [line.split()[:3] for line in tried] == [["rep", "0", "ddp"], ["rep", "0", "zeromem"]]
    assert all("failed:" in line for line in tried)  # and not tried again in the second rep


def test_every_system_gets_the_batch_deepspeed_resolves_from_the_config():
    """train_batch_size with one of the other two gives the third, per DeepSpeed's rules, on
    the bench's ranks; "auto" (the HF Trainer's to fill) counts as absent."""
    def batch(config: dict, world: int) -> list:
        resolved = resolved_config(config, world, stage="3")
        assert resolved["zero_optimization"]["stage"] == 3
        return [resolved[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps")]
    assert batch({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2) == [16, 4, 2]
    assert batch({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 4) == [16, 2, 2]
    assert batch({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3,
                  "gradient_accumulation_steps": "auto"}, 2) == [6, 3, 1]
    with pytest.raises(ConfigError, match="not divisible"):
        batch({"train_batch_size": 10, "gradient_accumulation_steps": 2}, 4)


def test_the_table_gives_ratios_to_ddp_and_the_skipped_systems():
    bench = Bench("m:f", CONFIG, systems=("ddp", "zeromem", "deepspeed"))
    results = {"ddp": Result([0.2, 0.4, 0.3], 5_000_000, [2.5, 2.0]),
               "zeromem": Result([0.15, 0.15], 3_000_000, [2.5, 2.0], 2)}
    lines = table(bench, results).splitlines()
    assert lines[1].split() == ["ddp", "300.0", "1.00", "5.0", "2.500000", "2.000000"]
    assert lines[2].split() == ["zeromem", "150.0", "0.50", "3.0", "2.500000", "2.000000"]
    if importlib.util.find_spec("deepspeed") is None:
        assert lines[3] == "skipped deepspeed: deepspeed is not installed"


class CharLM(nn.Module):
    """A character-level model: 65 tokens, a 256-position table (larger than the vocabulary).
    With a config (nanoGPT's), the position table comes first: only the config tells."""

    def __init__(self, config: dict | None = None):
        super().__init__()
        if config is not None:
            self.config = config
            self.positions = nn.Embedding(256, 8)
        self.tokens, self.positions = nn.Embedding(65, 8), nn.Embedding(256, 8)
        self.head = nn.Linear(8, 65)

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("config", [None, {"vocab_size": 65, "block_size": 256}])
def test_tokens_are_drawn_from_the_vocabulary_not_the_largest_embedding(config):
    """The position table outnumbers the vocabulary: tokens drawn up to its size index out
    of the token embedding in every system (the bench failed them all), and the planner
    sized the logits by it."""
    model = CharLM(config)
    inputs = _Inputs.of(model, micro_batch=4, seq=200)
    (tokens, targets), _ = inputs.batch(seed=0, device=torch.device("cpu"))
    assert inputs.vocab == 65 and int(tokens.max()) < 65 and int(targets.max()) < 65
    assert shape_of(model, config).vocab == 65
    model(tokens, targets)


def test_a_vision_config_builds_its_named_head_and_gets_images():
    """A config saved with `architectures` (ViTForImageClassification) is built as that
    class, as from_pretrained builds it (the auto classes gave the headless ViTModel, which
    returns no loss), and its forward gets images of the config's size and class labels
    (token ids failed in every system)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32, image_size=(16, 24), patch_size=8,
                                    num_channels=2, num_labels=5,
                                    architectures=["ViTForImageClassification"])
    model = load_hf_model({**config.to_dict(), "model_type": "vit"}, "cpu")
    assert type(model).__name__ == "ViTForImageClassification"
    args, kwargs = _Inputs.of(model, micro_batch=3, seq=7).batch(seed=0, device=torch.device("cpu"))
    assert args == () and kwargs["pixel_values"].shape == (3, 2, 16, 24)
    assert kwargs["labels"].shape == (3,) and int(kwargs["labels"].max()) < 5
    assert model(**kwargs).loss.numel() == 1


@pytest.mark.parametrize("kind", ["swin", "resnet"])
def test_hierarchical_vision_configs_get_images(kind):
    """Swin's config gives per-stage lists (`num_heads` [2, 2]) under a size's usual name,
    which was read as one size (int() of a list), and ResNet's `get_input_embeddings` raises
    NotImplementedError: both failed in every system before a step. Lists are not sizes, and
    a model without token inputs has no token embedding."""
    transformers = pytest.importorskip("transformers")
    if kind == "swin":
        config = transformers.SwinConfig(image_size=16, patch_size=4, embed_dim=8, depths=[1, 1],
                                         num_heads=[2, 2], window_size=2, num_labels=3,
                                         architectures=["SwinForImageClassification"])
    else:
        config = transformers.ResNetConfig(embedding_size=4, hidden_sizes=[4, 8], depths=[1, 1],
                                           num_labels=3, architectures=["ResNetForImageClassification"])
    model = load_hf_model({**config.to_dict(), "model_type": kind}, "cpu")
    inputs = _Inputs.of(model, micro_batch=2, seq=7)
    args, kwargs = inputs.batch(seed=0, device=torch.device("cpu"))
    assert args == () and kwargs["pixel_values"].shape[:2] == (2, 3)
    assert model(**kwargs).loss.numel() == 1
    assert "heads" not in model_dims(model, config.to_dict())  # Swin's is one a stage
