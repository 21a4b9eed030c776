"""torch.distributed.checkpoint (DCP) directories read without running their pickles.

A DCP directory (FSDP2 scripts, torchtitan, Accelerate's FSDP `save_state`) is an index,
`.metadata`, and the ranks' `*.distcp` files. torch reads the index with `pickle.load`
and each non-tensor entry (an lr, a step, a `BytesIO`) with `torch.load(weights_only=False)`:
either could run code. Here the index goes through an unpickler that builds only DCP's own
index records (`_IndexUnpickler`; anything else is refused, naming the global), and every
entry, tensor or not, through `torch.load(weights_only=True)`. What comes back is the state
dict the run saved, as torch's `dcp_to_torch_save` would write it: torch_import.py takes it
from there. Each rank reads the whole checkpoint into its memory (DCP's planner copies every
piece into one whole tensor).

Accelerate's `save_state` with FSDP keeps the model and the optimizer in two DCP
directories beside each other, `pytorch_model_fsdp_0/` ({"model": ...}) and `optimizer_0/`
({"optimizer": ...}); a directory holding them is read as the one state dict they make.
"""
from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from zeromem.checkpoints.tensor_files import CheckpointError

log = logging.getLogger("zeromem")
INDEX = ".metadata"
ACCELERATE = ("pytorch_model_fsdp_0", "optimizer_0")  # save_state's model, optimizer folders

# the index's records, and the torch values they hold (a dtype is any torch attribute that is one)
_INDEX_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "StorageMeta", "MetadataIndex", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def dcp_directories(path: Path) -> list[Path] | None:
    """The DCP directories `path` is: itself, or Accelerate's pair inside it; None if neither."""
    if (path / INDEX).is_file():
        return [path]
    found = [path / name for name in ACCELERATE if (path / name / INDEX).is_file()]
    return found or None


def read_dcp(directories: list[Path], needed: tuple[str, ...]) -> dict[str, Any]:
    """The state dict `directories` hold together (Accelerate's: model, then optimizer).
    A non-tensor entry that `weights_only` cannot read (a script's config object, a
    dataloader's pickled state) is refused under the top-level keys `needed`, and left out,
    with a warning, elsewhere: the import does not need it, and reading it could run code."""
    state: dict[str, Any] = {}
    for directory in directories:
        state.update(_read_one(directory, needed))
    return state


class _IndexUnpickler(pickle.Unpickler):
    """Builds DCP's index records only: any other global is refused before it is looked up."""

    def __init__(self, file: io.BufferedReader, index: Path):
        super().__init__(file)
        self.index = index

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _INDEX_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise CheckpointError(f"{self.index} refers to {module}.{name}, which a DCP index "
                                  "does not hold: not loaded (unpickling it could run code)")
        return super().find_class(module, name)


class _Reader(FileSystemReader):
    """torch's reader of the `.distcp` files (tensors: weights_only already), given the
    index `_read_index` read."""

    def __init__(self, directory: Path, metadata: Metadata):
        super().__init__(directory)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def _read_index(directory: Path) -> Metadata:
    index = directory / INDEX
    try:
        with open(index, "rb") as file:
            metadata = _IndexUnpickler(file, index).load()
    except CheckpointError:
        raise
    except Exception as error:  # a damaged pickle fails in many ways
        raise CheckpointError(f"{index} is not a DCP index: {type(error).__name__}: {error}") \
            from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{index} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class _Planner(_EmptyStateDictLoadPlanner):
    """Rebuilds the saved state dict (torch's), its non-tensor entries read with weights_only."""

    def __init__(self, needed: tuple[str, ...]):
        super().__init__()
        self.needed = needed

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:  # DCP hands byte entries back as BytesIO (torchtitan's older train_state)
            with torch.serialization.safe_globals([io.BytesIO]):
                loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            why = (f"not tensors, containers, numbers and strings (torch.load with "
                   f"weights_only=True: {str(error).splitlines()[0]})")
            if fqn.split(".")[0] in self.needed:
                raise CheckpointError(f"entry {fqn!r} is {why}") from None
            log.warning("DCP entry %r left out: it is %s, and the import does not need it",
                        fqn, why)
            return
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _read_one(directory: Path, needed: tuple[str, ...]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    reader = _Reader(directory, _read_index(directory))
    try:
        _load_state_dict(state, storage_reader=reader, planner=_Planner(needed),
                         no_dist=True)
    except CheckpointException as failed:  # DCP gathers each failure, with its traceback
        error = next((e for e, _ in failed.failures.values()), failed)
        if isinstance(error, CheckpointError):
            raise CheckpointError(f"{directory}: {error}") from None
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{directory} could not be read as a DCP checkpoint: {first}") \
            from None
    return state
