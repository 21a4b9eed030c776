"""The checkpoint format, usable without a process group, and `zeromem consolidate`.

File-level half of the layout described in `checkpoints/save_load.py` (which holds the
engine-level half): checksums, the JSON codec for small state, the piece index
of a manifest, the publishing protocol (`.tmp-<tag>` -> `<tag>` -> `latest`) and
`consolidate()`, which turns any checkpoint into one full fp32 state dict with
memory bounded by CHUNK_BYTES whatever the model size. The streaming safetensors
and torch.save files themselves are written and read by `checkpoints/tensor_files.py`; its
names are re-exported here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from zeromem.checkpoints.formats import describe_directory
from zeromem.leftovers import OWNER, reclaim_stale, write_owner
from zeromem.checkpoints.manifest import validate_manifest
from zeromem.checkpoints.tensor_files import (CHUNK_BYTES, CheckpointError, SafetensorsReader, TensorSpec,
                           shape_numel, write_output)
# Re-exported: these lived here before checkpoints/tensor_files.py; tests and callers import them from here.
from zeromem.checkpoints.tensor_files import (load_consolidated, tensor_bytes, write_safetensors,  # noqa: F401
                           write_state_dict, write_torch_stream)

log = logging.getLogger("zeromem")

FORMAT = "zeromem-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
CLIENT_STATE = "client_state.pt"


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def file_digest(path: Path) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, read in CHUNK_BYTES blocks."""
    digest, size = hashlib.sha256(), 0
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return digest.hexdigest(), size


OK, MISSING, WRONG_SIZE, WRONG_SHA256, OUTSIDE = 0, 1, 2, 3, 4


def verify_file(path: Path, sha256: str, nbytes: int) -> int:
    """OK, or why `path` does not match the manifest's checksum and size."""
    if not is_inside(path.parent, path):
        return OUTSIDE
    if not path.is_file():
        return MISSING
    if path.stat().st_size != nbytes:
        return WRONG_SIZE
    return OK if file_digest(path)[0] == sha256 else WRONG_SHA256


def describe_problem(code: int, path: Path, nbytes: int) -> str:
    if code == MISSING:
        return f"checkpoint file {path} is missing (the manifest lists it)"
    if code == OUTSIDE:
        return f"checkpoint file {path} is a link to {path.resolve()}, outside the checkpoint"
    if code == WRONG_SIZE:
        size = path.stat().st_size if path.is_file() else "?"
        return (f"checkpoint file {path} is truncated or was altered: {size} bytes, "
                f"expected {nbytes}")
    return f"checkpoint file {path} is corrupted: its sha256 does not match the manifest"


def raise_problems(path: Path, files: list[dict], codes: list[int]) -> None:
    """One CheckpointError listing every file whose code is not OK."""
    problems = [describe_problem(c, path / f["name"], f["bytes"])
                for f, c in zip(files, codes) if c]
    if problems:
        raise CheckpointError("; ".join(problems))


# ---------------------------------------------------------------- JSON codec for small state

def encode(obj: Any, where: str) -> Any:
    """Small python state (scaler, scheduler, optimizer options) as JSON-able data."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if torch.is_tensor(obj):
        return {"__tensor__": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch."),
                "device": obj.device.type}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, where) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, where) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, f"{where}.{k}") for k, v in obj.items()}
        return {"__items__": [[encode(k, where), encode(v, where)] for k, v in obj.items()]}
    raise CheckpointError(f"cannot store {where}: a {type(obj).__name__} is not JSON-serialisable")


def decode(data: Any) -> Any:
    """The inverse of `encode` (tensors come back on the CPU)."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tensor__" in data:
        return torch.tensor(data["__tensor__"], dtype=getattr(torch, data["dtype"]))
    if "__tuple__" in data:
        return tuple(decode(v) for v in data["__tuple__"])
    if "__items__" in data:
        return {decode(k): decode(v) for k, v in data["__items__"]}
    return {k: decode(v) for k, v in data.items()}


# ---------------------------------------------------------------- pieces: the layout on disk

@dataclass(frozen=True)
class Piece:
    """Elements [offset, offset + numel) of parameter `param`, held in file `file`."""

    param: str
    offset: int
    numel: int
    file: str = ""


def pieces_by_param(manifest: dict) -> dict[str, list[Piece]]:
    """Every parameter's pieces, sorted by offset, from the manifest's per-file lists."""
    index: dict[str, list[Piece]] = {name: [] for name in manifest["params"]}
    for entry in manifest["files"]:
        for name, offset, numel in entry["pieces"]:
            if name not in index:
                raise CheckpointError(f"manifest: file {entry['name']} holds a piece of "
                                      f"{name!r}, which is not among its parameters")
            index[name].append(Piece(name, offset, numel, entry["name"]))
    for name, pieces in index.items():
        pieces.sort(key=lambda p: p.offset)
        check_coverage(name, pieces, shape_numel(manifest["params"][name]["shape"]))
    return index


def check_coverage(name: str, pieces: list[Piece], numel: int) -> None:
    """The sorted pieces of a parameter must tile [0, numel) exactly."""
    end = 0
    for p in pieces:
        if p.offset != end:
            raise CheckpointError(f"manifest: parameter {name!r} has no piece for elements "
                                  f"[{end}, {p.offset})" if p.offset > end else
                                  f"manifest: pieces of parameter {name!r} overlap at {p.offset}")
        end = p.offset + p.numel
    if end != numel:
        raise CheckpointError(f"manifest: parameter {name!r} has {numel} elements but its "
                              f"pieces cover {end}")


def overlaps(pieces: list[Piece], start: int, numel: int) -> Iterator[tuple[Piece, int, int, int]]:
    """(piece, start in the piece, start in [start, start + numel), length) of each overlap."""
    for p in pieces:
        a, b = max(p.offset, start), min(p.offset + p.numel, start + numel)
        if b > a:
            yield p, a - p.offset, a - start, b - a


# ---------------------------------------------------------------- resolving and reading

def is_inside(root: Path, path: Path) -> bool:
    """Whether `path`, links followed, lies in `root` (links followed too)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a link loop
        return False


def resolve_checkpoint(load_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """The directory of checkpoint `tag` (default: the one `latest` names) under `load_dir`.

    Only a plain name directly under `load_dir` is followed (no `..`, separators,
    absolute paths, or links leading elsewhere): a checkpoint directory someone
    else can write must not make the load read files outside it.
    """
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            tags = available_tags(root)
            raise CheckpointError(f"no {LATEST!r} file in {root}: pass tag= explicitly "
                                  f"(tags found: {tags})"
                                  + ("" if tags else f"; {describe_directory(root)}"))
        if not is_inside(root, latest):
            raise CheckpointError(f"{latest} is a link to {latest.resolve()}, outside {root}")
        tag = latest.read_text().strip()
        _check_loaded_tag(tag, f"{latest} names tag {tag!r}")
    else:
        _check_loaded_tag(str(tag), f"tag {str(tag)!r}")
    path = root / str(tag)
    for candidate in (path, root / f".old-{tag}"):
        if candidate.exists() and not is_inside(root, candidate):
            raise CheckpointError(f"checkpoint {candidate} is a link to {candidate.resolve()}, "
                                  f"outside {root}; refusing to follow it")
    if (path / MANIFEST).is_file():
        return path
    old = root / f".old-{tag}"
    if not path.exists() and (old / MANIFEST).is_file():
        log.warning("checkpoint %s was being overwritten when a save stopped; loading %s",
                    path, old)
        return old
    if path.is_dir():
        raise CheckpointError(f"{path / MANIFEST} is missing: {path} is not a complete "
                              f"checkpoint; {describe_directory(path)}")
    raise CheckpointError(f"unknown checkpoint tag {str(tag)!r}: {path} does not exist "
                          f"(tags found: {available_tags(root)})")


def available_tags(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if not p.name.startswith(".") and (p / MANIFEST).is_file())


def read_manifest(path: Path) -> dict:
    """The parsed manifest of checkpoint directory `path`, with its format checked."""
    file = path / MANIFEST
    if file.exists() and not is_inside(path, file):
        raise CheckpointError(f"{file} is a link to {file.resolve()}, outside the checkpoint")
    try:
        text = file.read_text()
        manifest = json.loads(text)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file} cannot be read: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        what = manifest.get("format", "missing") if isinstance(manifest, dict) else "missing"
        raise CheckpointError(f"{file} is not a zeromem checkpoint manifest "
                              f"(field format: {what!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {manifest.get('version')}; this "
                              f"zeromem reads version {VERSION}")
    validate_manifest(text, file)  # every field, before anything reads or applies one
    return manifest


def checked_files(manifest: dict) -> list[dict]:
    """Every file the manifest vouches for, with its sha256 and size."""
    files = list(manifest["files"])
    if manifest.get("client_state"):
        files.append(manifest["client_state"])
    return files


# ---------------------------------------------------------------- publishing protocol
# Writers fill `.tmp-<tag>`; `publish` renames it into place; `latest` changes last
# (`resolve_checkpoint` above is the reading side, with the `.old-<tag>` fallback).

def _check_loaded_tag(tag: str, what: str) -> None:
    """A tag to load must be a plain name in the directory, as `check_tag` makes saved ones."""
    if not _plain_name(tag) or tag == LATEST:
        raise CheckpointError(f"{what}: a checkpoint tag must be a plain, non-hidden directory "
                              "name (no '..', '/', absolute path); refusing to follow it")


def _plain_name(name: str) -> bool:
    return bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0") \
        and os.sep not in name and not os.path.isabs(name)


def check_tag(tag: str) -> str:
    """`tag` if it is a plain directory name that cannot clash with the protocol's own."""
    if not _plain_name(tag) or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain, non-hidden directory "
                              f"name other than {LATEST!r}")
    return tag


TMP_PREFIX = ".tmp-"


def prepare_tmp(root: Path, tmp: Path) -> None:
    """A fresh `.tmp-<tag>` directory owned by this process.

    `.tmp-*` directories of saves whose process is gone (killed mid-save: each one
    a whole checkpoint's size) are removed first; a live run's are left alone.
    """
    root.mkdir(parents=True, exist_ok=True)
    reclaim_stale(root, TMP_PREFIX, keep=tmp)
    shutil.rmtree(tmp, ignore_errors=True)  # this tag's, left by a save that stopped
    tmp.mkdir()
    write_owner(tmp)


def write_manifest(tmp: Path, manifest: dict) -> None:
    """The manifest, fsynced: the last file written into `.tmp-<tag>`."""
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())


def publish(root: Path, tmp: Path, tag: str) -> None:
    """Rename the finished directory to `<tag>`; an existing tag is moved aside first."""
    final, old = root / tag, root / f".old-{tag}"
    (tmp / OWNER).unlink(missing_ok=True)  # a published checkpoint belongs to no process
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)  # between these renames, loading falls back to .old-<tag>
    os.rename(tmp, final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def write_one_rank(root: Path, tag: str, specs: list[TensorSpec], manifest: dict) -> None:
    """An imported checkpoint: `specs` (whole parameters, `master/<name>` among them) as one
    rank's file of `root/<tag>`, the manifest's file list filled in, published, and
    `latest` pointed at it; nothing is left behind on an error."""
    tmp = root / f"{TMP_PREFIX}{tag}"
    prepare_tmp(root, tmp)
    try:
        sha, size = write_safetensors(tmp / rank_file_name(0), specs, {"format": FORMAT,
                                                                       "rank": "0"})
        pieces = [[name, 0, shape_numel(p["shape"])] for name, p in manifest["params"].items()]
        manifest["files"] = [{"name": rank_file_name(0), "rank": 0, "sha256": sha,
                              "bytes": size, "pieces": pieces}]
        write_manifest(tmp, manifest)
        publish(root, tmp, tag)
        write_latest(root, tag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_latest(root: Path, tag: str) -> None:
    """Point `latest` at `tag` with one atomic replace, after the directory is published."""
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


# DeepSpeed copies these into the directory saved into, and HF's docs run them from there
# (`python zero_to_fp32.py . OUTPUT_DIR`); ours start zeromem's, which read this checkpoint
RECOVERY_SCRIPTS = {"zero_to_fp32.py": "zeromem.deepspeed.utils.zero_to_fp32",
                    "zero_to_torch.py": "zeromem.deepspeed.utils.zero_to_torch"}
_RECOVERY_SCRIPT = '''#!/usr/bin/env python
"""Written by zeromem's save_checkpoint, where DeepSpeed writes its own {name}:

    python {name} CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [--max_shard_size 5GB]
"""
from {module} import main

if __name__ == "__main__":
    main()
'''


def write_recovery_scripts(root: Path) -> None:
    """The scripts DeepSpeed leaves beside its checkpoints, executable, each written whole."""
    for name, module in RECOVERY_SCRIPTS.items():
        tmp = root / f".{name}.tmp"
        tmp.write_text(_RECOVERY_SCRIPT.format(name=name, module=module))
        tmp.chmod(0o755)
        os.replace(tmp, root / name)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- consolidation

def verify_files(path: Path, manifest: dict) -> None:
    """Check every file the manifest lists against its sha256 and size (streamed)."""
    files = checked_files(manifest)
    raise_problems(path, files, [verify_file(path / f["name"], f["sha256"], f["bytes"])
                                 for f in files])


def consolidate(ckpt_dir: str | os.PathLike, out_path: str | os.PathLike,
                tag: str | None = None) -> str:
    """Write a checkpoint's full fp32 model state dict to `out_path`; no process group, no GPU.

    Keys are the model's `state_dict()` keys; trained parameters come from the fp32
    masters, buffers and frozen parameters from rank 0's file (floating ones as
    fp32). `.safetensors` output stores a tied weight once and lists its other keys
    in the metadata (`aliases`; `load_consolidated` restores them); any other
    suffix is a `torch.save` file in which tied keys share one tensor. Tensors are
    streamed in chunks of CHUNK_BYTES, so memory stays bounded by that, not by the
    model. Every file is checked against its checksum first. Returns `out_path`.
    """
    with checkpoint_tensors(ckpt_dir, tag) as (path, manifest, spec_of):
        aliases = manifest["aliases"]
        specs = [spec_of(key) for key in manifest["state_dict_keys"] if key not in aliases]
        write_output(Path(out_path), specs, manifest["state_dict_keys"], aliases)
    if manifest.get("frozen_parameters_excluded"):
        log.warning("%s may lack frozen parameters (saved with exclude_frozen_parameters, or "
                    "a DeepSpeed stage-1 checkpoint): %s holds only the keys it has", path,
                    out_path)
    log.info("consolidated %s into %s", path, out_path)
    return str(out_path)


def read_state_dict(ckpt_dir: str | os.PathLike, tag: str | None = None,
                    exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """`consolidate`'s state dict in memory (tensors on the CPU; tied keys share one tensor),
    without frozen parameters if `exclude_frozen` (`output_keys`)."""
    with checkpoint_tensors(ckpt_dir, tag) as (path, manifest, spec_of):
        keys, aliases = output_keys(manifest, exclude_frozen, path), manifest["aliases"]
        whole = {key: read_whole(spec_of(key)) for key in keys if key not in aliases}
    return {key: whole[aliases.get(key, key)] for key in keys}


def output_keys(manifest: dict, exclude_frozen: bool, path: Path) -> list[str]:
    """The state_dict keys a reader of the checkpoint at `path` gives: all of them, or, with
    `exclude_frozen` (DeepSpeed's `exclude_frozen_parameters`), the trained parameters and
    the buffers, without the frozen parameters and the keys tied to them."""
    keys = manifest["state_dict_keys"]
    if not exclude_frozen:
        return keys
    frozen = manifest.get("frozen_parameters")
    if frozen is None:
        raise CheckpointError(f"{path}: written before checkpoints named their frozen "
                              "parameters, so exclude_frozen_parameters cannot tell them from "
                              "buffers; read it whole, or save it again")
    aliases, left_out = manifest["aliases"], set(frozen)
    return [key for key in keys if aliases.get(key, key) not in left_out]


def read_whole(spec: TensorSpec) -> torch.Tensor:
    """The tensor `spec` streams, whole, in memory."""
    out = torch.empty(shape_numel(spec.shape), dtype=spec.dtype)
    at = 0
    for chunk in spec.chunks():  # views of one scratch buffer: copied before the next
        out[at:at + chunk.numel()].copy_(chunk.reshape(-1))
        at += chunk.numel()
    return out.view(spec.shape)


@contextmanager
def checkpoint_tensors(ckpt_dir: str | os.PathLike, tag: str | None = None
                       ) -> Iterator[tuple[Path, dict, Callable[[str], TensorSpec]]]:
    """(checkpoint directory, manifest, spec_of) of a checked checkpoint, files open.

    `spec_of(key)` is the TensorSpec of a canonical (non-alias) state_dict key: trained
    parameters as their fp32 masters, buffers and frozen parameters as rank 0 saved
    them (floating ones as fp32), streamed in chunks through one CHUNK_BYTES scratch
    buffer, so a chunk must be used before the next is asked for. Every file is
    checked against its checksum before this yields.
    """
    path = resolve_checkpoint(ckpt_dir, tag)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    index = pieces_by_param(manifest)
    with ExitStack() as stack:
        readers: dict[str, SafetensorsReader] = {}

        def reader(name: str) -> SafetensorsReader:
            if name not in readers:
                readers[name] = stack.enter_context(SafetensorsReader(path / name))
            return readers[name]

        scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)  # every read goes through it
        yield path, manifest, lambda key: _consolidated_spec(key, manifest, index, reader, scratch)


def _consolidated_spec(key: str, manifest: dict, index: dict[str, list[Piece]],
                       reader: Callable[[str], SafetensorsReader],
                       scratch: torch.Tensor) -> TensorSpec:
    if key in manifest["params"]:
        def master_chunks() -> Iterator[torch.Tensor]:
            for piece in index[key]:
                yield from reader(piece.file).read_chunks(f"master/{key}", 0, piece.numel,
                                                          scratch)
        return TensorSpec(key, torch.float32, tuple(manifest["params"][key]["shape"]),
                          master_chunks)
    info = manifest["module_tensors"].get(key)
    if info is None:
        raise CheckpointError(f"manifest lists state_dict key {key!r} but holds no tensor for it")
    dtype = getattr(torch, info["dtype"])
    out_dtype = torch.float32 if dtype.is_floating_point else dtype

    def module_chunks() -> Iterator[torch.Tensor]:
        file = reader(rank_file_name(0))
        numel = shape_numel(info["shape"])
        for chunk in file.read_chunks(f"module/{key}", 0, numel, scratch):
            yield chunk.to(out_dtype)
    return TensorSpec(key, out_dtype, tuple(info["shape"]), module_chunks)
