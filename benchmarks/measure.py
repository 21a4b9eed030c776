"""What the comparative benchmark measures in each worker process.

Peak RSS (VmHWM after a reset through /proc/self/clear_refs), bytes written to
sockets (/proc/self/io wchar, i.e. what gloo actually sent), bytes moved to and from
storage (its read_bytes / write_bytes), and a census of
the distinct tensor storages reachable from a model and its optimizer/engine
(the model-state bytes a system really holds).
"""
from __future__ import annotations

import os
import re
import types
from typing import Any


def rss_bytes() -> int:
    """Current resident set size, from /proc/self/statm (pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """High-water mark of the resident set (VmHWM) since start or the last reset."""
    with open("/proc/self/status") as f:
        match = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024


def reset_peak_rss() -> bool:
    """Make VmHWM equal the current RSS (Linux >= 4.0); False if the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_io() -> dict[str, int]:
    """This process's I/O counters (/proc/self/io), all threads."""
    with open("/proc/self/io") as f:
        return {key: int(value) for key, value in (line.split(": ") for line in f)}


def bytes_written() -> int:
    """Bytes this process passed to write-like syscalls, sockets included (all threads)."""
    return _proc_io()["wchar"]


def storage_bytes() -> dict[str, int]:
    """Bytes this process read from and wrote to storage (the block layer's count, direct
    I/O included, page-cache hits not): any system measured alike, not from its own ledger."""
    io = _proc_io()
    return {"read_bytes": io["read_bytes"], "written_bytes": io["write_bytes"]}


# ----------------------------------------------------------------------------- tensor census


def _local(tensor: Any) -> Any:
    """The rank-local tensor behind a DTensor (FSDP2), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage_id(tensor: Any) -> tuple[int, int] | None:
    storage = _local(tensor).untyped_storage()
    if storage.nbytes() == 0 or _local(tensor).device.type == "meta":
        return None
    return storage.data_ptr(), storage.nbytes()


SKIPPED_TYPES = (str, bytes, int, float, bool, type, types.FunctionType, types.MethodType,
                 types.BuiltinFunctionType, types.ModuleType)


def _reachable(root: Any, max_depth: int = 8) -> tuple[list[Any], list[Any]]:
    """Tensors and torch optimizers reachable from `root` through attributes and containers."""
    import torch

    tensors, optimizers, seen = [], [], set()
    stack = [(root, 0)]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or depth > max_depth or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            continue
        if isinstance(obj, SKIPPED_TYPES):
            continue
        if isinstance(obj, torch.optim.Optimizer):
            optimizers.append(obj)
        if isinstance(obj, dict):
            children = list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in (
                "torch", "deepspeed", "zeromem", "__main__", "gpt"):
            children = list(vars(obj).values())
        else:
            continue
        stack.extend((child, depth + 1) for child in children)
    return tensors, optimizers


def count_model_state(model: Any, root: Any) -> dict[str, int]:
    """Bytes of distinct storages by category, each storage counted once, first category wins."""
    tensors, optimizers = _reachable(root)
    params = list(model.parameters())
    param_ids = {id(p) for p in params}
    groups = {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer_state": [t for opt in optimizers for state in opt.state.values()
                            for t in state.values() if hasattr(t, "untyped_storage")],
        "master_params": [p for opt in optimizers for group in opt.param_groups
                          for p in group["params"] if id(p) not in param_ids],
    }
    groups["master_grads"] = [p.grad for p in groups["master_params"] if p.grad is not None]
    groups["other_buffers"] = tensors
    counted: set[tuple[int, int]] = set()
    totals: dict[str, int] = {}
    for name, members in groups.items():
        totals[name] = 0
        for tensor in members:
            key = _storage_id(tensor)
            if key is not None and key not in counted:
                counted.add(key)
                totals[name] += key[1]
    totals["total"] = sum(totals.values())
    return totals


def sum_nested(value: Any) -> int:
    """Sum of all numbers in a nested dict (zeromem's reports are {category: {place: bytes}})."""
    if isinstance(value, dict):
        return sum(sum_nested(v) for v in value.values())
    return int(value) if isinstance(value, (int, float)) else 0


# ----------------------------------------------------------------------------- systems
