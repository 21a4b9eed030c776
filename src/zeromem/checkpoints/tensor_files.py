"""Tensor files written and read without holding a whole model in memory.

The byte-level layer under the checkpoint format (`checkpoints/consolidate.py`) and
`save_16bit_model` (`checkpoints/model_weights.py`): a streaming safetensors writer, whose
header is built from shapes so tensors can be produced one chunk at a time; a
safetensors reader of element ranges with plain reads (no mmap); a streaming
`torch.save` writer that fills a skeleton archive in place; and the state-dict
file writer and reader (`write_output`, `write_state_dict`, `load_consolidated`)
that pick between the two formats by suffix.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

CHUNK_BYTES = 8 << 20  # streaming unit for hashing, consolidation and large reads


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file or parameter.

    Defined here, the lowest layer that raises it; re-exported by `consolidate`,
    `checkpoints` and the package.
    """


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
        return shape_numel(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape), lambda: [tensor])


def shape_numel(shape: Iterable[int]) -> int:
    """Number of elements of a tensor of `shape` (1 for a scalar's empty shape)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of `tensor` (copied only if it is on a device or not contiguous)."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer


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
        total = shape_numel(shape)
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
            got = self.file.readinto(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
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


# ---------------------------------------------------------------- state-dict files

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
