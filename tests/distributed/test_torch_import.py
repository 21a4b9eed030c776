"""`engine.load_checkpoint(file)` of one torch file (checkpoints/torch_import.py): what it refuses.

Each refusal leaves the engine as it was (the import fills a temporary checkpoint, which
the ordinary loader checks before anything changes); the parity of what it accepts is
test_from_fsdp2.py's, against FSDP2 itself.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import zeromem
from harness import run_distributed
from models import TinyLM
from zeromem.checkpoints.tensor_files import CheckpointError

CONFIG = {"train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _adam_state(model: torch.nn.Module) -> dict:
    """AdamW's state dict keyed by name, as get_state_dict gives it (after 3 steps)."""
    names = [n for n, p in model.named_parameters()]
    return {"state": {n: {"step": torch.tensor(3.0), "exp_avg": torch.ones_like(p),
                          "exp_avg_sq": torch.ones_like(p)}
                      for n, p in model.named_parameters() if p.requires_grad},
            "param_groups": [{**torch.optim.AdamW([torch.zeros(1)]).defaults, "params": names}]}


class Planted:
    """A pickled object that runs a command when unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def refusals(rank: int, world_size: int, where: str) -> dict[str, str]:
    torch.manual_seed(0)
    engine = zeromem.initialize(TinyLM(), CONFIG)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    other, weights, wrapped, plain = TinyLM(dim=12), TinyLM(), TinyLM(), TinyLM()
    files = {
        "another model": {"model": other.state_dict(), "optimizer": _adam_state(other)},
        "another optimizer": {"model": TinyLM().state_dict(), "optimizer": {
            "state": {}, "param_groups": [{**torch.optim.SGD([torch.zeros(1)], lr=0.1).defaults,
                                           "params": ["fc1.weight"]}]}},
        "weights only": {"model": weights.state_dict()},
        # decay / no-decay, numbered matrices first: not the model's order, which the count
        # of trained parameters would otherwise match
        "numbered groups": {"model": weights.state_dict(), "optimizer": torch.optim.AdamW(
            [{"params": [p for p in weights.parameters() if p.requires_grad and p.ndim == 2]},
             {"params": [p for p in weights.parameters() if p.requires_grad and p.ndim < 2]}]
        ).state_dict()},
    }
    code, marker = f"{where}/code.pt", Path(where) / "ran"
    if rank == 0:  # one file each, which every rank loads
        for name, content in files.items():
            torch.save(content, f"{where}/{name.replace(' ', '_')}.pt")
        torch.save({"model": weights.state_dict(), "extra": Planted(str(marker))}, code)
        torch.save({"model": weights.state_dict()}, f"{where}/latest.pt")  # the pointer's name
        # DDP's and torch.compile's parts in every key, as a wrapped model's state_dict has them
        torch.save({"model": {f"module._orig_mod.{k}": v for k, v in wrapped.state_dict().items()}},
                   f"{where}/wrapped.pt")
        # Hugging Face's way: safetensors, the tied head left out
        save_file({k: v for k, v in plain.state_dict().items() if k != "head.weight"},
                  f"{where}/plain.safetensors")
        # DCP directories: a planted entry the import needs (an optimizer option) and one it
        # does not (left out), and a planted index (.metadata is a pickle)
        dcp.save({"model": weights.state_dict(), "optimizer": {"state": {}, "param_groups": [
            {"lr": Planted(str(marker)), "params": ["fc1.weight"]}]}},
            checkpoint_id=f"{where}/dcp_entry", no_dist=True)
        dcp.save({"model": weights.state_dict(), "extra": Planted(str(marker))},
                 checkpoint_id=f"{where}/dcp_extra", no_dist=True)
        dcp.save({"model": weights.state_dict()}, checkpoint_id=f"{where}/dcp_index", no_dist=True)
        Path(f"{where}/dcp_index/.metadata").write_bytes(pickle.dumps(Planted(str(marker))))
    dist.barrier()
    errors = {}
    for name in files:
        with pytest.raises(CheckpointError) as error:
            engine.load_checkpoint(f"{where}/{name.replace(' ', '_')}.pt")
        errors[name] = str(error.value)
    with pytest.raises(CheckpointError) as error:
        engine.load_checkpoint(code)
    errors["a pickle"] = str(error.value) + (" RAN" if marker.exists() else "")
    for name in ("dcp_entry", "dcp_index"):
        with pytest.raises(CheckpointError) as error:
            engine.load_checkpoint(f"{where}/{name}")
        errors[name] = str(error.value) + (" RAN" if marker.exists() else "")
    after = engine.full_state_dict()
    errors["unchanged"] = str(all(torch.equal(before[k], after[k]) for k in before)
                              if rank == 0 else True)
    # the weights alone, where the file has no optimizer state and none is asked for
    for name, model in (("latest.pt", weights), ("wrapped.pt", wrapped),
                        ("plain.safetensors", plain), ("dcp_extra", weights)):
        engine.load_checkpoint(f"{where}/{name}", load_optimizer_states=False)
        loaded = engine.full_state_dict()
        errors[f"{name} loaded"] = str(all(torch.equal(loaded[k], v) for k, v in
                                           model.state_dict().items()) if rank == 0 else True)
    errors["ran after all"] = " RAN" if marker.exists() else ""  # dcp_extra's entry left out
    return errors


def test_a_torch_file_not_of_this_run_is_refused_before_anything_changes(tmp_path):
    for got in run_distributed(refusals, 2, str(tmp_path)):
        assert "another model" in got["another model"] and "shape" in got["another model"]
        assert "sgd optimizer states but this engine uses adamw" in got["another optimizer"]
        assert "load_optimizer_states=False" in got["weights only"]
        assert "2 param groups" in got["numbered groups"]
        assert "get_state_dict" in got["numbered groups"]
        assert "weights_only=True" in got["a pickle"] and "RAN" not in got["a pickle"]
        assert "entry 'optimizer.param_groups.0.lr'" in got["dcp_entry"]
        assert "weights_only=True" in got["dcp_entry"]
        assert "system, which a DCP index does not hold" in got["dcp_index"]
        assert "RAN" not in got["dcp_entry"] + got["dcp_index"] + got["ran after all"]
        assert got["unchanged"] == "True", got
        assert all(got[f"{name} loaded"] == "True" for name in (
            "latest.pt", "wrapped.pt", "plain.safetensors", "dcp_extra")), got
