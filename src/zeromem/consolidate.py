"""The checkpoint format, usable without a process group, and `zeromem consolidate`.

File-level half of the layout described in `checkpoints.py` (which holds the
engine-level half): streaming safetensors I/O (a writer whose header is built
from shapes, so tensors can be produced one chunk at a time; a reader of element
ranges with plain reads, no mmap), checksums, the JSON codec for small state,
the piece index of a manifest, the publishing protocol (`.tmp-<tag>` -> `<tag>`
-> `latest`) and `consolidate()`, which turns any checkpoint into one full fp32
state dict with memory bounded by CHUNK_BYTES whatever the model size.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import zipfile
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

log = logging.getLogger("zeromem")

FORMAT = "zeromem-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
CLIENT_STATE = "client_state.pt"
CHUNK_BYTES = 8 << 20  # streaming unit for hashing, consolidation and large reads


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file or parameter."""


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# ---------------------------------------------------------------- safetensors streaming I/O

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_ST_TORCH = {name: dtype for dtype, name in _ST_DTYPES.items()}


@dataclass
class TensorSpec:
    """One tensor to write: its header entry, and a function yielding its data in order."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape), lambda: [tensor])


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of `tensor` (copied only if it is on a device or not contiguous)."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(path: Path, specs: list[TensorSpec], metadata: dict[str, str],
                      sink: Callable[[bytes | memoryview], None] | None = None) -> tuple[str, int]:
    """Write a safetensors file tensor by tensor, fsync it; returns (sha256 hex, bytes).

    Memory stays bounded by the largest chunk a spec yields: the header is built
    from shapes alone, so no tensor has to exist before its turn.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": _ST_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        def put(buf) -> None:
            f.write(buf)
            digest.update(buf)
        put(struct.pack("<Q", len(raw)))
        put(raw)
        for spec in specs:
            written = 0
            for chunk in spec.chunks():
                put(tensor_bytes(chunk))
                written += chunk.numel() * chunk.element_size()
                del chunk  # before the next one is produced
            if written != spec.nbytes:
                raise CheckpointError(f"{path}: tensor {spec.name} produced {written} bytes, "
                                      f"expected {spec.nbytes}")
        f.flush()
        os.fsync(f.fileno())
        return digest.hexdigest(), f.tell()


class SafetensorsReader:
    """Reads element ranges of 1-D views of tensors with plain reads (no mmap).

    Only the requested bytes are read, straight into the caller's buffer, so the
    memory used is what the caller asks for.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = open(self.path, "rb")
        size = os.fstat(self.file.fileno()).st_size
        try:
            (n,) = struct.unpack("<Q", self.file.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(self.file.read(n))
        except (struct.error, ValueError) as error:
            self.file.close()
            raise CheckpointError(f"{self.path} is not a readable safetensors file: {error}")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict] = header
        self.data_start = 8 + n

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def info(self, key: str) -> tuple[torch.dtype, list[int]]:
        entry = self.entries.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor {key!r}")
        return _ST_TORCH[entry["dtype"]], entry["shape"]

    def read(self, key: str, start: int = 0, numel: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, start + numel) of tensor `key` flattened, into `out` if given."""
        dtype, shape = self.info(key)
        total = _numel(shape)
        numel = total - start if numel is None else numel
        if start < 0 or start + numel > total:
            raise CheckpointError(f"{self.path}: elements [{start}, {start + numel}) are outside "
                                  f"tensor {key!r} of {total} elements")
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        if out.dtype != dtype or out.numel() != numel or not out.is_contiguous():
            raise CheckpointError(f"{self.path}: tensor {key!r} is {dtype}, cannot read into "
                                  f"{out.dtype} x {out.numel()}")
        if numel:
            begin = self.entries[key]["data_offsets"][0] + start * dtype.itemsize
            self.file.seek(self.data_start + begin)
            got = self.file.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))
            if got != numel * dtype.itemsize:
                raise CheckpointError(f"{self.path} is truncated: tensor {key!r} ends early")
        return out

    def read_chunks(self, key: str, start: int, numel: int,
                    scratch: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """Elements [start, start + numel) in chunks of at most CHUNK_BYTES.

        Every chunk is a view of `scratch` (uint8, CHUNK_BYTES; one is made if not
        given): use it before asking for the next. Reusing one scratch buffer for a
        whole job keeps the allocator from piling up freed chunk-sized blocks.
        """
        dtype, _ = self.info(key)
        step = max(1, CHUNK_BYTES // dtype.itemsize)
        if scratch is None:
            scratch = torch.empty(min(step, numel) * dtype.itemsize, dtype=torch.uint8)
        for lo in range(start, start + numel, step):
            n = min(step, start + numel - lo)
            yield self.read(key, lo, n, out=scratch[:n * dtype.itemsize].view(dtype))


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


OK, MISSING, WRONG_SIZE, WRONG_SHA256 = 0, 1, 2, 3


def verify_file(path: Path, sha256: str, nbytes: int) -> int:
    """OK, or why `path` does not match the manifest's checksum and size."""
    if not path.is_file():
        return MISSING
    if path.stat().st_size != nbytes:
        return WRONG_SIZE
    return OK if file_digest(path)[0] == sha256 else WRONG_SHA256


def describe_problem(code: int, path: Path, nbytes: int) -> str:
    if code == MISSING:
        return f"checkpoint file {path} is missing (the manifest lists it)"
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
        check_coverage(name, pieces, _numel(manifest["params"][name]["shape"]))
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

def resolve_checkpoint(load_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """The directory of checkpoint `tag` (default: the one `latest` names) under `load_dir`."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"no {LATEST!r} file in {root}: pass tag= explicitly "
                                  f"(tags found: {available_tags(root)})")
        tag = latest.read_text().strip()
    path = root / str(tag)
    if (path / MANIFEST).is_file():
        return path
    old = root / f".old-{tag}"
    if not path.exists() and (old / MANIFEST).is_file():
        log.warning("checkpoint %s was being overwritten when a save stopped; loading %s",
                    path, old)
        return old
    if path.is_dir():
        raise CheckpointError(f"{path / MANIFEST} is missing: {path} is not a complete checkpoint")
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
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file} cannot be read: {error}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a zeromem checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {manifest.get('version')}; this "
                              f"zeromem reads version {VERSION}")
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

def check_tag(tag: str) -> str:
    """`tag` if it is a plain directory name that cannot clash with the protocol's own."""
    if not tag or tag.startswith(".") or tag == LATEST or "/" in tag or os.sep in tag:
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain, non-hidden directory "
                              f"name other than {LATEST!r}")
    return tag


def prepare_tmp(root: Path, tmp: Path) -> None:
    """A fresh, empty `.tmp-<tag>` directory (a stale one from a stopped save is removed)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save that stopped
    tmp.mkdir()


def write_manifest(tmp: Path, manifest: dict) -> None:
    """The manifest, fsynced: the last file written into `.tmp-<tag>`."""
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())


def publish(root: Path, tmp: Path, tag: str) -> None:
    """Rename the finished directory to `<tag>`; an existing tag is moved aside first."""
    final, old = root / tag, root / f".old-{tag}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)  # between these renames, loading falls back to .old-<tag>
    os.rename(tmp, final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def write_latest(root: Path, tag: str) -> None:
    """Point `latest` at `tag` with one atomic replace, after the directory is published."""
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


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
    path = resolve_checkpoint(ckpt_dir, tag)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    index = pieces_by_param(manifest)
    aliases = manifest["aliases"]
    with ExitStack() as stack:
        readers: dict[str, SafetensorsReader] = {}

        def reader(name: str) -> SafetensorsReader:
            if name not in readers:
                readers[name] = stack.enter_context(SafetensorsReader(path / name))
            return readers[name]

        scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)  # every read goes through it
        specs = [_consolidated_spec(key, manifest, index, reader, scratch)
                 for key in manifest["state_dict_keys"] if key not in aliases]
        write_output(Path(out_path), specs, manifest["state_dict_keys"], aliases)
    log.info("consolidated %s into %s", path, out_path)
    return str(out_path)


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
        for chunk in file.read_chunks(f"module/{key}", 0, _numel(info["shape"]), scratch):
            yield chunk.to(out_dtype)
    return TensorSpec(key, out_dtype, tuple(info["shape"]), module_chunks)


def write_output(out: Path, specs: list[TensorSpec], keys: list[str],
                 aliases: dict[str, str]) -> None:
    """A state dict file, atomically: safetensors for `.safetensors`, else torch.save format."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if out.suffix == ".safetensors":
            write_safetensors(tmp, specs, {"format": "zeromem-state-dict", "keys": json.dumps(keys),
                                           "aliases": json.dumps(aliases)})
        else:
            write_torch_stream(tmp, specs, keys, aliases)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_state_dict(out: Path, state: dict[str, torch.Tensor]) -> None:
    """`write_output` for tensors in memory; keys naming one tensor twice become aliases."""
    first: dict[int, str] = {}
    aliases = {k: first.setdefault(id(t), k) for k, t in state.items()}
    aliases = {k: v for k, v in aliases.items() if k != v}
    specs = [TensorSpec.of(k, t) for k, t in state.items() if k not in aliases]
    write_output(out, specs, list(state), aliases)


def write_torch_stream(path: Path, specs: list[TensorSpec], keys: list[str],
                       aliases: dict[str, str]) -> None:
    """A `torch.save` file written without holding the tensors: torch writes the
    archive with the storages' space left empty (`skip_data` over fake tensors), then
    each storage record is filled in place, chunk by chunk, and its CRC-32 set."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fakes = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs}
    state = {k: fakes[aliases.get(k, k)] for k in keys}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, path)
    by_name = {s.name: s for s in specs}
    order: dict[int, TensorSpec] = {}  # torch numbers storages in order of first appearance
    for k in keys:
        order.setdefault(id(state[k]), by_name[aliases.get(k, k)])
    _fill_torch_records(path, list(order.values()))


def _fill_torch_records(path: Path, specs: list[TensorSpec]) -> None:
    with zipfile.ZipFile(path) as zf:
        infos = {i.filename.split("/", 1)[-1]: i for i in zf.infolist()}
        central = zf.start_dir
    crcs: dict[str, int] = {}
    with open(path, "r+b") as f:
        for i, spec in enumerate(specs):
            info = infos.get(f"data/{i}")
            if info is None or info.file_size != spec.nbytes:
                raise CheckpointError(f"{path}: torch.save laid out storage {i} unexpectedly "
                                      f"for {spec.name}")
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            f.seek(info.header_offset + 30 + name_len + extra_len)
            crc = written = 0
            for chunk in spec.chunks():
                buf = tensor_bytes(chunk)
                f.write(buf)
                crc, written = zlib.crc32(buf, crc), written + len(buf)
                del chunk, buf  # before the next one is produced
            if written != spec.nbytes:
                raise CheckpointError(f"{path}: tensor {spec.name} produced {written} bytes, "
                                      f"expected {spec.nbytes}")
            f.seek(info.header_offset + 14)  # CRC-32 field of the local header
            f.write(struct.pack("<I", crc))
            crcs[info.filename] = crc
        _patch_central_crcs(f, central, crcs)
        f.flush()
        os.fsync(f.fileno())


def _patch_central_crcs(f, offset: int, crcs: dict[str, int]) -> None:
    """Set the CRC-32 of the named records in the zip central directory at `offset`."""
    while True:
        f.seek(offset)
        head = f.read(46)
        if len(head) < 46 or head[:4] != b"PK\x01\x02":
            return
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        name = f.read(name_len).decode()
        if name in crcs:
            f.seek(offset + 16)
            f.write(struct.pack("<I", crcs[name]))
        offset += 46 + name_len + extra_len + comment_len


def load_consolidated(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a file written by `consolidate` or `save_16bit_model`, aliases restored."""
    path = Path(path)
    if path.suffix != ".safetensors":
        return torch.load(path, map_location="cpu", weights_only=True)
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    keys = json.loads(meta.get("keys", "null")) or list(tensors)
    aliases = json.loads(meta.get("aliases", "{}"))
    return {k: tensors[aliases.get(k, k)] for k in keys}
