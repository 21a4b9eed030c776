"""The model's weights for inference, gathered whole onto rank 0 (DeepSpeed's
`save_16bit_model`), apart from the training checkpoints of save_load.py, which keep
masters and optimizer states in shards."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from zeromem.checkpoints.agreement import collective
from zeromem.checkpoints.save_load import frozen_keys
from zeromem.checkpoints.tensor_files import CheckpointError, write_state_dict
from zeromem.module_state import gathered_state_dict
from zeromem.training_state import TrainingState


def save_16bit_model(state: TrainingState, save_dir: str | os.PathLike,
                     filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> str:
    """Save the model's weights in the compute dtype to `save_dir/filename` (rank 0); collective.

    Keys as `module.state_dict()`; trained parameters are the fp32 masters cast to
    the compute dtype, gathered one flat group at a time; buffers and frozen
    parameters as held. `.safetensors` names give a safetensors file (tied
    weights stored once, aliases in the metadata), others a torch.save file. At
    stage 3 this needs `zero_optimization.stage3_gather_16bit_weights_on_model_save`.
    `exclude_frozen_parameters` leaves out parameters with requires_grad False.
    """
    if state.zero_stage == 3 and not state.gather_16bit_weights:
        raise CheckpointError(
            "save_16bit_model at ZeRO stage 3 must gather the partitioned parameters onto "
            "rank 0, which zeromem does only when "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save is true; set it, or "
            "call save_checkpoint and run `zeromem consolidate CKPT_DIR OUT`")
    weights = weights_16bit(state, exclude_frozen_parameters, keep=state.comm.rank == 0)
    path = Path(save_dir) / filename
    collective(state, "saving the 16-bit model",
               lambda: write_state_dict(path, weights) if state.comm.rank == 0 else None)
    return str(path)



def weights_16bit(state: TrainingState, exclude_frozen_parameters: bool,
                  keep: bool) -> dict[str, torch.Tensor]:
    """The model's whole state dict where `keep` ({} elsewhere), keys as the module's own:
    trained parameters in the compute dtype, buffers and frozen parameters as held; collective
    over the shards' group. DeepSpeed's `_zero3_consolidated_16bit_state_dict`, which HF's
    `save_model` calls at stage 3, and what `save_16bit_model` writes."""
    with state.all_in_memory():
        weights = gathered_state_dict(state.module, state.groups + state.frozen_groups, state.comm,
                                      state.compute_dtype, keep)
    if exclude_frozen_parameters:
        frozen = frozen_keys(state)
        weights = {k: v for k, v in weights.items() if k not in frozen}
    return weights
