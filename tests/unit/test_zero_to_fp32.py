"""`deepspeed.utils.zero_to_fp32` on DeepSpeed's own checkpoints (no process group).

Users switching from DeepSpeed keep calling these on the checkpoints DeepSpeed wrote:
the masters must be the ones DeepSpeed's API reported when the checkpoint was made
(expected.json's fingerprints), tied weights one tensor, and the files
`convert_zero_checkpoint_to_fp32_state_dict` writes loadable as HF names them.
The same calls on a zeromem checkpoint: tests/distributed/test_param_states.py.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from models import TinyLM
from setups import deepspeed_case
from zeromem.deepspeed.utils import zero_to_fp32


def fingerprint(t: torch.Tensor) -> dict:
    t = t.float().flatten()
    return {"sum": t.sum().item(), "sumsq": (t * t).sum().item(), "head": t[:4].tolist()}


# stage3_ws2_fp32_nvme: ZeRO-Infinity's, on which DeepSpeed 0.19.8's own reader fails
@pytest.mark.parametrize("name", ["stage3_ws2_bf16", "stage2_ws2_fp16", "stage1_ws2_bf16",
                                  "stage3_ws2_fp32_nvme"])
def test_deepspeed_checkpoints_read_whole(name, tmp_path):
    src, expected = deepspeed_case(name)
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(src)
    model = TinyLM(hidden=expected.get("hidden", 7))
    assert state.keys() == model.state_dict().keys()
    for param, states in expected["states"].items():
        if param == "__step__":
            continue
        got, want = fingerprint(state[param]), states["master"]
        assert state[param].dtype == torch.float32
        assert got["sum"] == pytest.approx(want["sum"], rel=1e-6, abs=1e-9), param
        assert got["head"] == pytest.approx(want["head"], rel=1e-6, abs=1e-9), param
    assert state["head.weight"] is state["embed.weight"]  # tied: one tensor, as DeepSpeed's
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(model, src)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key].to(value.dtype), rtol=0, atol=0, msg=key)

    out = tmp_path / "out"
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(src, out, max_shard_size=2000,
                                                           safe_serialization=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("model-00001-of-")
    assert index["weight_map"].keys() == state.keys()
    assert index["metadata"]["total_size"] == sum(
        t.numel() * 4 for k, t in state.items() if k != "head.weight")  # the tie stored once
    read = {}
    for file in files:
        with safe_open(out / file, framework="pt") as f:
            read.update({k: f.get_tensor(k) for k in f.keys()})
    assert index["weight_map"]["head.weight"] == index["weight_map"]["embed.weight"]
    for key, value in read.items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
    assert read.keys() == state.keys() - {"head.weight"}  # its source's file holds the tie


def test_the_command_deepspeed_copies_into_checkpoints(tmp_path):
    """`python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR`, as DeepSpeed users run it."""
    src, _ = deepspeed_case("stage3_ws2_fp32")
    run = subprocess.run([sys.executable, "-m", "zeromem.deepspeed.utils.zero_to_fp32", str(src),
                          str(tmp_path / "out"), "-t", "global_step3"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    want = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(src)
    assert saved.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", ["stage3_ws2_fp32", "stage2_ws2_fp32_two_groups",
                                  "stage1_ws2_bf16", "stage3_ws2_fp16_exclude_frozen"])
def test_frozen_parameters_left_out_as_deepspeeds_own_reader_does(name):
    """`exclude_frozen_parameters=True`: the trained parameters and the buffers, as
    DeepSpeed 0.19.8's zero_to_fp32 gives them on these checkpoints (TinyLM's `frozen`
    layer out); lazily, the same tensors when read."""
    src, _ = deepspeed_case(name)
    whole = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(src)
    trained = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        src, exclude_frozen_parameters=True)
    assert list(trained) == [k for k in TinyLM().state_dict() if not k.startswith("frozen.")]
    assert trained["head.weight"] is trained["embed.weight"]
    imports = Path(tempfile.gettempdir()).glob("zeromem-deepspeed-*")
    before = set(imports)
    lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        src, exclude_frozen_parameters=True, lazy_mode=True)
    assert lazy.keys() == trained.keys()
    for key, value in zero_to_fp32.to_torch_tensor(lazy).items():
        torch.testing.assert_close(value, whole[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(trained[key], whole[key], rtol=0, atol=0, msg=key)
    imported = set(Path(tempfile.gettempdir()).glob("zeromem-deepspeed-*")) - before
    assert len(imported) == 1  # the import the lazy tensors read from, kept while they live
    del lazy
    gc.collect()
    assert not any(p.exists() for p in imported)  # and removed with the last of them


@pytest.mark.parametrize("name, stage, model_file", [
    ("stage3_ws2_bf16", 3, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ("stage2_ws2_fp16", 2, "mp_rank_00_model_states.pt")])
def test_deepspeeds_own_files_named_as_lightning_reads_them(name, stage, model_file):
    """Lightning's converter reads the stage from the first optimizer file and its own
    state from the rank-0 model-states file of the tag directory."""
    src, _ = deepspeed_case(name)
    tag_dir = src / (src / "latest").read_text().strip()
    files = zero_to_fp32.get_optim_files(tag_dir)
    assert [f.rsplit("/", 1)[1].split("zero_pp_rank_")[1][:1] for f in files] == ["0", "1"]
    assert all(f.endswith("_optim_states.pt") for f in files)
    assert zero_to_fp32.get_model_state_file(tag_dir, stage) == str(tag_dir / model_file)
