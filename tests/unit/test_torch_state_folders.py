"""Which folders `engine.load_checkpoint` imports as a run's torch state
(checkpoints/torch_import.py `is_torch_state`), decided from the names of their files."""
from __future__ import annotations

from pathlib import Path

import pytest

from zeromem.checkpoints.torch_import import is_torch_state


def folder(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"")
    return root


@pytest.mark.parametrize("names, imported", [
    (("model.safetensors", "optimizer.bin", "random_states_0.pkl"), True),  # Accelerate, DDP
    (("model.safetensors", "optimizer.pt", "trainer_state.json"), True),    # HF Trainer
    (("pytorch_model_fsdp.bin", "optimizer.bin"), True),                    # FSDP full state
    (("pytorch_model_fsdp.bin",), True),                                    # its weights alone
    (("pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"), True),    # FSDP sharded
    ((".metadata", "__0_0.distcp"), True),                                  # a DCP directory
    (("config.json", "model.safetensors"), False),       # a from_pretrained folder: a hint
    (("latest", "global_step2/mp_rank_00_model_states.pt", "model.safetensors",
      "optimizer.pt"), False),                           # DeepSpeed's (or zeromem's) own
    (("optimizer.pt",), False),
])
def test_folders_imported_as_torch_state(tmp_path, names, imported):
    assert is_torch_state(folder(tmp_path, *names)) is imported
