"""Asynchronous file I/O for NVMe offload (ZeRO-Infinity, arXiv 2104.07857, section 5).

The pieces, from the bottom up:

- `aligned_empty`: a uint8 host tensor whose first byte sits on a 4096-byte
  boundary (an over-allocated tensor, sliced). O_DIRECT needs the buffer
  address, the file offset and the length all aligned, so every buffer here is
  `ALIGN`-aligned, every file record starts at an `ALIGN` multiple and every
  request length is rounded up to `ALIGN`.
- `BufferPool`: `count` such buffers carved from one arena. The arena is the
  only host memory swapping uses; buffers are lent and returned, never grown.
- `AsyncIO`: a thread pool that splits each request into chunks and runs
  `os.preadv` / `os.pwritev` on them (the GIL is released during the system
  call, so the threads overlap each other and the optimizer's kernels). From the
  `aio` block (`from_config`), a chunk is `block_size x queue_depth` bytes, the
  bytes one DeepSpeed libaio thread keeps in flight, and there are
  `2 x intra_op_parallelism` threads.
- `SwapFile`: one preallocated file, opened with O_DIRECT when the filesystem
  accepts it (probed with a real aligned write); otherwise buffered I/O, and
  every write is followed by `fdatasync` so that data reaches the disk as it
  would with direct I/O. Which mode is used is in `SwapFile.direct`.
- `SwapSpace`: the per-rank directory `nvme_path/zeromem-rank{r}-{pid}-XXXX/` that
  holds the files; removed by `close()`, by garbage collection or at exit. A
  process killed by a signal removes nothing, so each directory records its
  owner (`leftovers.py`) and a new space removes those of processes that are gone.

Every failure (a missing or unwritable path, ENOSPC, a short read of a
truncated file) is an `OffloadError` naming the file, raised to the caller of
`IOHandle.wait()`. A handle waits for all of its chunks before raising, so a
buffer is never handed back while a transfer into it is still running.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch

from zeromem.leftovers import reclaim_stale, write_owner

log = logging.getLogger("zeromem")

SPACE_PREFIX = "zeromem-rank"

ALIGN = 4096  # bytes; covers 512-byte and 4K logical sectors


class OffloadError(RuntimeError):
    """Offload storage failed (path, space, or I/O); the message names the file."""


def round_up(nbytes: int, align: int = ALIGN) -> int:
    """`nbytes` rounded up to a multiple of `align`."""
    return -(-nbytes // align) * align


def swap_file_bytes(nbytes: int) -> int:
    """The size a swap file asked for `nbytes` is created with (whole ALIGN blocks)."""
    return round_up(max(1, nbytes))


def piece_range(start: int, numel: int, itemsize: int = 4) -> tuple[int, int]:
    """(first byte, length) of the ALIGN blocks holding elements [start, start + numel)
    (fp32, or `itemsize` bytes each) of a record that starts on a block: the request that
    reads or writes that piece."""
    begin = start * itemsize // ALIGN * ALIGN
    return begin, round_up(start * itemsize - begin + numel * itemsize)


def piece_view(start: int, numel: int, buf: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Where a `piece_range` request puts elements [start, start + numel) in the aligned
    uint8 `buf`: past the bytes of the first block that precede the piece."""
    skip = start * dtype.itemsize % ALIGN
    return buf[skip:skip + numel * dtype.itemsize].view(dtype)


def piece_bytes(numel: int) -> int:
    """Buffer bytes a `piece_range` request of `numel` elements needs, wherever it starts
    (fp32; a 16-bit piece's request fits in as many)."""
    return round_up(numel * 4) + ALIGN


def aligned_nbytes(nbytes: int) -> int:
    """Host bytes `aligned_empty(nbytes)` allocates: ALIGN more, to start on a boundary."""
    return nbytes + ALIGN


def aligned_empty(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised uint8 host tensor of `nbytes` starting at an ALIGN boundary."""
    raw = torch.empty(aligned_nbytes(nbytes), dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


class BufferPool:
    """`count` aligned buffers of `buffer_bytes` (rounded up to ALIGN) from one arena."""

    def __init__(self, count: int, buffer_bytes: int, pin_memory: bool = False):
        self.count = count
        self.buffer_bytes = round_up(max(1, buffer_bytes))
        self.arena = aligned_empty(count * self.buffer_bytes, pin_memory)
        size = self.buffer_bytes
        self.free = [self.arena[i * size:(i + 1) * size] for i in range(count)]

    @staticmethod
    def bytes_for(count: int, buffer_bytes: int) -> int:
        """Host bytes a pool of `count` buffers of `buffer_bytes` holds (what `nbytes` reports)."""
        return aligned_nbytes(count * round_up(max(1, buffer_bytes)))

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds (the arena, alignment slack included)."""
        return self.arena.untyped_storage().nbytes()

    def acquire(self) -> torch.Tensor | None:
        """A free buffer, or None when all are lent out."""
        return self.free.pop() if self.free else None

    def take(self) -> torch.Tensor:
        """A free buffer, for owners that sized the pool to their needs."""
        buffer = self.acquire()
        if buffer is None:
            raise OffloadError(f"all {self.count} swap buffers are lent out")
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)


@dataclass
class IOStats:
    """Bytes moved by one `AsyncIO` and the time callers spent blocked waiting for them."""

    read_bytes: int = 0
    written_bytes: int = 0
    wait_s: float = 0.0  # the caller's thread blocked in `IOHandle.wait()`

    def minus(self, earlier: IOStats) -> IOStats:
        return IOStats(self.read_bytes - earlier.read_bytes,
                       self.written_bytes - earlier.written_bytes, self.wait_s - earlier.wait_s)

    def plus(self, other: IOStats) -> IOStats:
        return IOStats(self.read_bytes + other.read_bytes,
                       self.written_bytes + other.written_bytes, self.wait_s + other.wait_s)


class IOHandle:
    """Chunks of one read or write in flight; `wait()` blocks and raises OffloadError."""

    def __init__(self, futures: list[Future], finish: Callable[[], None] | None = None,
                 stats: IOStats | None = None):
        self.futures = futures
        self.finish = finish
        self.stats = stats
        self._done = not futures  # every chunk finished: the answer cannot change after

    def done(self) -> bool:
        """Every chunk has finished (with or without an error; `wait()` raises it). Polled
        often by the step's pipeline, so the last chunk (the likeliest still running, the
        pool being FIFO) is asked first and a True is kept."""
        if not self._done:
            self._done = all(f.done() for f in reversed(self.futures))
        return self._done

    @property
    def settled(self) -> bool:
        """`wait()` has run (its errors raised), or there was nothing to wait for."""
        return not self.futures

    def wait(self) -> None:
        if self.stats is not None and self.futures and not self.done():
            start = time.perf_counter()
            try:
                self._wait()
            finally:
                self.stats.wait_s += time.perf_counter() - start
        else:
            self._wait()

    def _wait(self) -> None:
        error = None
        for f in self.futures:
            try:
                f.result()
            except BaseException as e:  # keep waiting: no chunk may still write into the buffer
                error = error or e
        self.futures = []
        if error is not None:
            raise error
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


def _failure(op: str, nbytes: int, offset: int, path: Path, e: OSError) -> OffloadError:
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else "?"
    return OffloadError(f"{op} of {nbytes} bytes at offset {offset} of {path} failed: "
                        f"{os.strerror(e.errno) if e.errno else e} [{name}]")


def _transfer(op: str, fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Move all of `view` at `offset`; a zero-length transfer is a short read/write."""
    done, total = 0, len(view)
    call = os.preadv if op == "read" else os.pwritev
    while done < total:
        try:
            n = call(fd, [view[done:]], offset + done)
        except OSError as e:
            raise _failure(op, total, offset, path, e) from e
        if n == 0:
            raise OffloadError(f"short {op} of {path}: {done} of {total} bytes at offset {offset} "
                               "(file truncated or device full?)")
        done += n


def _transfer_after(after: list[Future], op: str, fd: int, view: memoryview, offset: int,
                    path: Path) -> None:
    """`_transfer` once the requests `after` have finished (their errors raise here). They
    were submitted before to the same FIFO pool, or to another: running or done, so the
    thread this waits in never holds up one of them."""
    for f in after:
        f.result()
    _transfer(op, fd, view, offset, path)


class AsyncIO:
    """A thread pool issuing block-sized positional reads and writes."""

    # the defaults: what `from_config` makes of DeepSpeed's default block (1 MiB x 8, 1 lane)
    def __init__(self, block_size: int = 8 << 20, threads: int = 2):
        self.block_size = round_up(block_size)
        self.threads = max(1, threads)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="zeromem-aio")
        self.stats = IOStats()  # since construction; `Offload.end_step` takes per-step deltas

    @classmethod
    def from_config(cls, aio) -> AsyncIO:
        """From the `aio` config block, read as DeepSpeed's libaio means it: each of
        `intra_op_parallelism` threads keeps `queue_depth` requests of `block_size` bytes in
        flight. A thread here blocks in one system call at a time, so its chunk is those
        bytes in one call: the kernel splits a direct-I/O call into the device's request size
        and queues the pieces together, the same depth at the device. Two threads a lane, so
        that a read and a write are in flight at once (DeepSpeed's swappers keep a read and
        a write handle). A thread per queued request, as before, cost the step CPU beyond
        the I/O's own: wake-ups and GIL hand-offs with the main thread (issue 16; README,
        "The aio block")."""
        return cls(aio.block_size * aio.queue_depth, 2 * aio.intra_op_parallelism)

    def submit(self, op: str, fd: int, buffer: torch.Tensor, offset: int, path: Path,
               finish: Callable[[], None] | None = None,
               after: Sequence[IOHandle] = ()) -> IOHandle:
        """Start reading (`op` "read") or writing `buffer` (uint8, host) at `offset`, each
        chunk once the requests `after` (submitted earlier) have finished."""
        view = memoryview(buffer.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
        step = self.block_size
        waits = [f for h in after for f in h.futures]
        move = partial(_transfer_after, waits) if waits else _transfer
        futures = [self.pool.submit(move, op, fd, view[s:s + step], offset + s, path)
                   for s in range(0, len(view), step)]
        if op == "read":
            self.stats.read_bytes += len(view)
        else:
            self.stats.written_bytes += len(view)
        return IOHandle(futures, finish, self.stats)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)


def _open(path: Path, direct: bool) -> int:
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    return os.open(path, flags, 0o600)


class SwapFile:
    """One preallocated swap file; reads and writes of aligned buffers at aligned offsets."""

    def __init__(self, path: Path, nbytes: int, io: AsyncIO, direct: bool = True):
        self.path = Path(path)
        self.nbytes = swap_file_bytes(nbytes)
        self.io = io
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.read_bytes = self.written_bytes = 0  # this file's share of `io.stats`
        self.fd = -1
        try:
            self.fd = self._open_probed()
            os.posix_fallocate(self.fd, 0, self.nbytes)  # ENOSPC now, not mid-training
        except OSError as e:
            self.close()
            raise _failure("allocation", self.nbytes, 0, self.path, e) from e

    def _open_probed(self) -> int:
        """Open with O_DIRECT if an aligned write through it works; else buffered."""
        if self.direct:
            try:
                fd = _open(self.path, True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            else:
                try:
                    probe = aligned_empty(ALIGN).zero_()  # the buffer itself must be aligned
                    os.pwritev(fd, [probe.numpy()], 0)  # type: ignore[list-item]  # a buffer
                    return fd
                except OSError as e:
                    os.close(fd)
                    if e.errno != errno.EINVAL:
                        raise
            log.info("%s: O_DIRECT not supported here; buffered I/O with fdatasync", self.path)
            self.direct = False
        return _open(self.path, False)

    def grow(self, nbytes: int) -> None:
        """Make the file at least `nbytes` long (a file appended to: `Init`'s shards)."""
        new = swap_file_bytes(nbytes)
        if new <= self.nbytes:
            return
        try:
            os.posix_fallocate(self.fd, self.nbytes, new - self.nbytes)
        except OSError as e:
            raise _failure("allocation", new, self.nbytes, self.path, e) from e
        self.nbytes = new

    def read(self, buffer: torch.Tensor, offset: int, after: Sequence[IOHandle] = ()) -> IOHandle:
        """Start reading `buffer.numel()` bytes (an ALIGN multiple) from `offset`, once the
        requests `after` have finished (writes still reading from `buffer`)."""
        self._check(buffer, offset)
        self.read_bytes += buffer.numel()
        return self.io.submit("read", self.fd, buffer, offset, self.path, after=after)

    def write(self, buffer: torch.Tensor, offset: int) -> IOHandle:
        """Start writing `buffer` at `offset`; buffered mode syncs before `wait()` returns."""
        self._check(buffer, offset)
        self.written_bytes += buffer.numel()
        finish = None if self.direct else self._sync
        return self.io.submit("write", self.fd, buffer, offset, self.path, finish)

    def _sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise _failure("fdatasync", self.nbytes, 0, self.path, e) from e

    def _check(self, buffer: torch.Tensor, offset: int) -> None:
        if offset % ALIGN or buffer.numel() % ALIGN or buffer.data_ptr() % ALIGN:
            raise ValueError(f"{self.path}: unaligned request (offset {offset}, "
                             f"{buffer.numel()} bytes at {buffer.data_ptr():#x})")
        if offset + buffer.numel() > self.nbytes:
            raise ValueError(f"{self.path}: request past the end ({offset} + {buffer.numel()} "
                             f"> {self.nbytes})")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _remove_space(directory: Path, files: list[SwapFile], io: AsyncIO) -> None:
    io.shutdown()
    for f in files:
        f.close()
    shutil.rmtree(directory, ignore_errors=True)


class SwapSpace:
    """This rank's swap directory under `nvme_path` and the files in it.

    Created at engine start (`nvme_path/zeromem-rank{rank}-{pid}-XXXX/`), removed by
    `close()`, when the space is garbage-collected, or at interpreter exit.
    """

    def __init__(self, nvme_path: str | os.PathLike, rank: int, io: AsyncIO, direct: bool = True):
        root = Path(nvme_path)
        if not root.is_dir():
            io.shutdown()
            what = "is not a directory" if root.exists() else "does not exist"
            raise OffloadError(f"nvme_path {root} {what}")
        reclaim_stale(root, SPACE_PREFIX)  # left by killed runs: each as large as its offload
        try:  # unique per engine: several engines may share a process and a path
            self.dir = Path(tempfile.mkdtemp(prefix=f"{SPACE_PREFIX}{rank}-{os.getpid()}-",
                                             dir=root))
            write_owner(self.dir)
        except OSError as e:
            io.shutdown()
            raise OffloadError(f"cannot create a swap directory under nvme_path {root}: "
                               f"{e.strerror or e}") from e
        self.io = io
        self.direct = direct
        self.files: list[SwapFile] = []
        self._finalizer = weakref.finalize(self, _remove_space, self.dir, self.files, io)

    def file(self, name: str, nbytes: int) -> SwapFile:
        """Create and preallocate the file `name` of at least `nbytes` bytes."""
        f = SwapFile(self.dir / name, nbytes, self.io, self.direct)
        self.files.append(f)
        return f

    def discard(self, file: SwapFile) -> None:
        """Close and remove one file before the space closes (its contents are no longer needed)."""
        file.close()
        file.path.unlink(missing_ok=True)
        self.files.remove(file)

    @property
    def nbytes(self) -> int:
        """Bytes of all files (their allocated sizes)."""
        return sum(f.nbytes for f in self.files)

    def close(self) -> None:
        """Wait for I/O in flight, close the files and remove the directory."""
        self._finalizer()
