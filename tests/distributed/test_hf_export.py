"""`zeromem consolidate CKPT OUT --hf CONFIG_DIR`: checkpoints out as Hugging Face models.

One spawned world of 2 gloo ranks trains tiny GPT-2 and Llama (built from configs,
nothing downloaded) at stages 2 and 3 (persistence threshold 0, so every parameter is
partitioned), in fp32 and bf16, one GPT-2 wrapped in a module (`module.` keys) and one
with its embedding (and so its tied head) frozen; each rank returns its whole weights
(gathered) and its logits on a probe batch. The
parent, with no process group, runs the command line and checks what
`from_pretrained` makes of the directory against every rank. A checkpoint real DeepSpeed
saved (tests/data/deepspeed_hf_checkpoint) is exported as well.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import zeromem
from harness import run_distributed
from setups import hf_tiny_builders
from zeromem.checkpoints.tensor_files import SafetensorsReader
from zeromem.cli import main

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 8, 2
CASES = {  # name -> (model, stage, training dtype, wrapped in a module)
    "gpt2-s2": ("gpt2", 2, "fp32", False),
    "llama-s3": ("llama", 3, "fp32", False),
    "gpt2-s3-bf16": ("gpt2", 3, "bf16", False),
    "llama-s2-bf16": ("llama", 2, "bf16", False),
    "gpt2-wrapped-s3": ("gpt2", 3, "fp32", True),
    "gpt2-s3-frozen-wte": ("gpt2", 3, "fp32", False),
}
# embeddings frozen, as fine-tunes that save memory freeze them: GPT-2's head is the same
# frozen tensor (its checkpoint was refused as damaged before stop 51)
FROZEN_EMBEDDINGS = {"gpt2-s3-frozen-wte"}
DATA = Path(__file__).parent.parent / "data"
DEEPSPEED_CHECKPOINT = DATA / "deepspeed_checkpoints" / "stage2_ws2_fp32"  # not an HF model
DEEPSPEED_GPT2 = DATA / "deepspeed_hf_checkpoint"  # tools/make_deepspeed_hf_checkpoint.py


class Wrapper(nn.Module):
    """A user's module around the HF model: every state_dict key gains `module.`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def engine_config(stage: int, dtype: str) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "bf16": {"enabled": dtype == "bf16"},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def train_and_save(rank: int, world_size: int, root: Path) -> None:
    """Per case: 2 steps, a checkpoint, the gathered weights and the probe logits."""
    out = {}
    for case, (name, stage, dtype, wrapped) in CASES.items():
        torch.manual_seed(0)
        model = hf_tiny_builders(vocab=VOCAB, seq=SEQ)[name]()
        if case in FROZEN_EMBEDDINGS:
            model.get_input_embeddings().requires_grad_(False)
        if rank == 0:
            model.config.save_pretrained(root / case / "config")
        engine = zeromem.initialize(Wrapper(model) if wrapped else model,
                                    engine_config(stage, dtype))
        for step in range(2):
            ids = tokens(10 * step + rank)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(root / case / "ckpt")
        masters = engine.full_state_dict()  # fp32, rank 0 only
        params = list(engine.module.parameters())
        with zeromem.GatheredParameters(params):  # whole on every rank, compute dtype
            weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        engine.module.eval()
        with torch.no_grad():
            logits = engine(input_ids=tokens(99)).logits.float()
        prefix = "module." if wrapped else ""
        out[case] = {"masters": {k.removeprefix(prefix): v for k, v in masters.items()},
                     "weights": {k.removeprefix(prefix): v for k, v in weights.items()},
                     "logits": logits}
    torch.save(out, root / f"rank{rank}.pt")  # tensors through the result queue die with the rank




@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("hf_export")
    run_distributed(train_and_save, 2, root)
    return root, [torch.load(root / f"rank{r}.pt") for r in range(2)]


def export(root: Path, case: str, out: str, *options: str) -> Path:
    target = root / case / out
    assert main(["consolidate", str(root / case / "ckpt"), str(target),
                 "--hf", str(root / case / "config"), *options]) == 0
    return target


def written(directory: Path) -> dict[str, tuple[str, str]]:
    """Every tensor in the directory's safetensors files: name -> (file, dtype)."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with SafetensorsReader(file) as reader:
            out.update({k: (file.name, reader.entries[k]["dtype"]) for k in reader.keys()})
    return out


def load(directory: Path, dtype: torch.dtype | None = None):
    """The export as HF loads it (`dtype`: parameters in it, the rotary buffer kept fp32)."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, dtype=dtype)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    return model.eval()


def assert_trained_weights(model, ranks: list[dict], case: str, dtype: torch.dtype) -> None:
    """Every tensor equals rank 0's gathered masters and every rank's whole weights."""
    loaded = model.state_dict()
    for rank, result in enumerate(ranks):
        expected = result[case]["weights"]
        assert loaded.keys() == expected.keys(), (rank, loaded.keys() ^ expected.keys())
        for key, value in expected.items():
            torch.testing.assert_close(loaded[key].to(dtype), value.to(dtype), rtol=0, atol=0,
                                       msg=f"rank {rank} {key}")
    for key, value in ranks[0][case]["masters"].items():
        torch.testing.assert_close(loaded[key].to(dtype), value.to(dtype), rtol=0, atol=0,
                                   msg=key)


@pytest.mark.parametrize("case", list(CASES))
def test_from_pretrained_gives_the_trained_weights_and_logits(trained, case):
    root, ranks = trained
    dtype = torch.bfloat16 if CASES[case][2] == "bf16" else torch.float32
    out = export(root, case, "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert {d for _, d in written(out).values()} == {"BF16" if dtype == torch.bfloat16 else "F32"}
    model = load(out, dtype)
    assert_trained_weights(model, ranks, case, dtype)
    with torch.no_grad():
        logits = model(input_ids=tokens(99)).logits.float()
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(logits, result[case]["logits"], rtol=0, atol=1e-5,
                                   msg=f"rank {rank}")


@pytest.mark.parametrize("case", ["gpt2-s3-bf16", "llama-s3"])
def test_sharded_output_is_what_save_pretrained_writes_and_loads(trained, case):
    """A small max size: several shards and an index, shard for shard and key for key
    as save_pretrained writes the same model (GPT-2's tied lm_head left out)."""
    root, ranks = trained
    dtype = torch.bfloat16 if CASES[case][2] == "bf16" else torch.float32
    out = export(root, case, "sharded", "--max-shard-size", "20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = written(out)
    assert len(set(index["weight_map"].values())) > 2
    assert index["weight_map"] == {k: f for k, (f, _) in files.items()}
    model = load(out)
    assert_trained_weights(model, ranks, case, dtype)
    # built in-process as training builds it (a model from from_pretrained saves its names
    # sorted, after transformers' weight-conversion pass)
    built = transformers.AutoModelForCausalLM.from_config(model.config).to(dtype)
    built.load_state_dict(model.state_dict())
    reference = root / case / "save_pretrained"
    built.save_pretrained(reference, max_shard_size="20KB")
    theirs = json.loads((reference / "model.safetensors.index.json").read_text())
    assert index == theirs
    assert files == written(reference)


def test_wrapped_models_keys_lose_the_prefix(trained):
    root, _ = trained
    keys = set(written(export(root, "gpt2-wrapped-s3", "prefix")))
    assert "transformer.wte.weight" in keys and not any(k.startswith("module.") for k in keys)


def test_dtype_is_the_override_else_the_configs_else_the_trainings(trained):
    root, _ = trained
    case = "gpt2-s3-bf16"
    assert json.loads((export(root, case, "default") / "config.json").read_text())["dtype"] \
        == "bfloat16"
    out = export(root, case, "fp32", "--dtype", "fp32")
    assert {d for _, d in written(out).values()} == {"F32"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    config = json.loads((root / case / "config" / "config.json").read_text())
    half = root / case / "config_fp16"
    half.mkdir()
    (half / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    target = root / case / "fp16"
    assert main(["consolidate", str(root / case / "ckpt"), str(target), "--hf", str(half)]) == 0
    assert {d for _, d in written(target).values()} == {"F16"}


def test_a_deepspeed_checkpoint_becomes_the_model_deepspeed_trained(tmp_path):
    """Real DeepSpeed's stage-3 bf16 checkpoint of a tiny GPT-2 (2 ranks): every weight as
    DeepSpeed's own `safe_get_full_fp32_param` gathered it; bf16 by default (its config)."""
    from safetensors.torch import load_file

    expected = load_file(DEEPSPEED_GPT2 / "expected.safetensors")  # the tied lm_head once
    for options, dtype in (([], torch.bfloat16), (["--dtype", "fp32"], torch.float32)):
        out = tmp_path / str(dtype)
        assert main(["consolidate", str(DEEPSPEED_GPT2 / "ckpt"), str(out),
                     "--hf", str(DEEPSPEED_GPT2 / "config"), *options]) == 0
        assert set(written(out)) == set(expected)
        loaded = load(out).state_dict()
        for key, value in expected.items():
            torch.testing.assert_close(loaded[key].to(dtype), value.to(dtype), rtol=0, atol=0,
                                       msg=key)
        assert loaded["lm_head.weight"].data_ptr() == loaded["transformer.wte.weight"].data_ptr()


def refused(root: Path, case: str, config: dict | Path, capsys, ckpt: Path | None = None) -> str:
    """The command's error line, after checking it wrote nothing beside the checkpoint."""
    if isinstance(config, dict):
        where = root / case / f"bad_config{len(list((root / case).glob('bad_config*')))}"
        where.mkdir()
        (where / "config.json").write_text(json.dumps(config))
    else:
        where = config
    target = root / case / "refused"
    before = sorted(p.name for p in (root / case).iterdir())
    assert main(["consolidate", str(ckpt or root / case / "ckpt"), str(target),
                 "--hf", str(where)]) == 2
    assert sorted(p.name for p in (root / case).iterdir()) == before  # no half-written directory
    return capsys.readouterr().err


def test_a_config_that_does_not_fit_is_refused_before_anything_is_written(trained, capsys):
    root, _ = trained
    gpt2 = json.loads((root / "gpt2-s2" / "config" / "config.json").read_text())
    assert "'transformer.h.2.ln_1.weight'" in refused(root, "gpt2-s2", {**gpt2, "n_layer": 3},
                                                       capsys)
    llama = json.loads((root / "llama-s3" / "config" / "config.json").read_text())
    error = refused(root, "llama-s3", {**llama, "vocab_size": VOCAB + 1}, capsys)
    assert "'model.embed_tokens.weight' has shape [64, 64]" in error
    error = refused(root, "llama-s3", {**llama, "tie_word_embeddings": True}, capsys)
    assert "ties 'lm_head.weight' to 'model.embed_tokens.weight'" in error
    # a DeepSpeed checkpoint is read as a source too: its tiny model is not a GPT-2
    error = refused(root, "gpt2-s2", root / "gpt2-s2" / "config", capsys, DEEPSPEED_CHECKPOINT)
    assert "does not fit the GPT2LMHeadModel" in error
    (root / "gpt2-s2" / "occupied").mkdir()
    (root / "gpt2-s2" / "occupied" / "mine.txt").write_text("keep")
    assert main(["consolidate", str(root / "gpt2-s2" / "ckpt"), str(root / "gpt2-s2" / "occupied"),
                 "--hf", str(root / "gpt2-s2" / "config")]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in (root / "gpt2-s2" / "occupied").iterdir()] == ["mine.txt"]
