"""DeepSpeed ZeRO-Infinity checkpoints: the sub-groups kept in swap files.

With `offload_optimizer.device: nvme`, DeepSpeed keeps a stage-3 sub-group's fp32
partition and its optimizer states in swap files once the partition reaches 1 MiB a rank
(smaller ones stay in memory). Its optimizer file then holds an empty tensor for each, and
`save_checkpoint` copies the rank's swap folder to `offloaded_tensors/rank{NN}/`: one raw
file per tensor, `{first}_{last}.tensor.swp` for the fp32 partition and
`{state}-{first}_{last}.tensor.swp` for each state (first and last: the ids of the
sub-group's first and last parameters), each padded to DeepSpeed's I/O alignment.
DeepSpeed's own converters (`zero_to_fp32`, `ds_to_universal`) read the empty tensors and
fail; here the files are read in their place.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from zeromem.checkpoints.tensor_files import CheckpointError

SWAPPED = re.compile(r"(\d+)_(\d+)\.tensor\.swp")  # a sub-group's fp32 partition


def swapped_in(path: Path, rank: int, numels: list[int], masters: list[torch.Tensor],
               states: list[dict]) -> tuple[list[torch.Tensor], list[dict]]:
    """`masters` and `states` (per sub-group, as rank `rank`'s optimizer file holds them)
    with every empty one (DeepSpeed's placeholder for a swapped tensor) read from that
    rank's swap files; `numels`: each sub-group's partition size on a rank."""
    empty = [i for i, (master, n) in enumerate(zip(masters, numels)) if master.numel() == 0 < n]
    if not empty:
        return masters, states
    folder = path / "offloaded_tensors" / f"rank{rank:02d}"
    files = sorted((m for m in map(SWAPPED.fullmatch, _names(folder)) if m),
                   key=lambda m: int(m.group(1)))  # sub-groups hold parameters in id order
    if len(files) != len(empty):
        raise CheckpointError(
            f"{folder}: {len(files)} swapped sub-group(s) for the {len(empty)} the optimizer "
            f"file of rank {rank} holds empty: the checkpoint is damaged or incomplete")
    masters, states = list(masters), [dict(s) for s in states]
    for i, match in zip(empty, files):
        masters[i] = _read(folder / match.group(0), numels[i], masters[i].dtype)
        for key, value in states[i].items():
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() == 0:
                states[i][key] = _read(folder / f"{key}-{match.group(0)}", numels[i], value.dtype)
    return masters, states


def _names(folder: Path) -> list[str]:
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is missing: the optimizer files hold empty partitions, whose values "
            "DeepSpeed (NVMe offload) saves there")
    return [f.name for f in folder.iterdir()]


def _read(file: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `numel` elements of a raw swap file (what follows is alignment padding)."""
    nbytes = numel * dtype.itemsize
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete")
    with file.open("rb") as f:
        data = bytearray(f.read(nbytes))
    if len(data) < nbytes:
        raise CheckpointError(f"{file} holds {len(data)} bytes where {numel} {dtype} values "
                              f"take {nbytes}: it is truncated")
    return torch.frombuffer(data, dtype=dtype)
