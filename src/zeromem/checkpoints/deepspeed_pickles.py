"""DeepSpeed's `.pt` files, unpickled without running code.

Every file is read with `torch.load(weights_only=True)` and an allowlist of the three
DeepSpeed classes its optimizer files pickle, rebuilt as inert stand-ins
(`_SAFE_GLOBALS`); anything else is refused with the global's name, except in the client
state. `save_checkpoint(client_state=...)` writes the caller's objects into the model
states file, and `load_checkpoint` hands them back: there numpy arrays are rebuilt (numpy's
own data constructors, as torch documents for weights_only loads), and objects of other
classes (Megatron-DeepSpeed's argparse arguments) become `ForeignObject`s, which hold what
was pickled (attributes, arguments) and run nothing. A key the import reads holding one is
refused as before (`load_pt`'s `read`).
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Callable

import numpy
import numpy.dtypes
import torch

from zeromem.checkpoints.tensor_files import CheckpointError

__all__ = ["ForeignObject", "LossScalerRecord", "load_object", "load_pt", "need"]


class _Record:
    """Stand-in for a pickled DeepSpeed object: its attributes, nothing callable."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class LossScalerRecord(_Record):
    """DeepSpeed's LossScaler or DynamicLossScaler, as its attributes."""


class _FragmentAddress(_Record):
    pass


class ForeignObject(_Record):
    """Stand-in for an object of a class outside the allowlist, in a checkpoint's client state:
    what was pickled (its attributes; `args`, `state` where the pickle gave those), nothing run.
    `global_name` names the class it stands for (a subclass per name)."""

    global_name = ""

    def __init__(self, *args: object) -> None:
        if args:
            self.args = args

    def __setstate__(self, state: object) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        return f"ForeignObject[{self.global_name}]({vars(self)})"


_SAFE_GLOBALS: list[tuple[Callable[..., Any], str]] = [
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),  # an int Enum: rebuilt as its int
]


def load_pt(path: Path, read: tuple[str, ...] | None = None) -> dict:
    """A DeepSpeed `.pt` file, unpickled without running code (weights_only + allowlist).

    `read`: the file holds client state, and these are the keys the import reads. Objects
    outside the allowlist become `ForeignObject`s; in a key of `read` they are refused."""
    data = load_object(path, foreign=read is not None)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not DeepSpeed's dict")
    for key in read or ():
        found = _first_foreign(data.get(key))
        if found is not None:
            raise CheckpointError(_could_run_code(path, [found.global_name], f" in {key!r}"))
    return data


def load_object(path: Path, foreign: bool = False) -> object:
    allowed = list[Any](_SAFE_GLOBALS)
    if foreign:
        allowed += _numpy_globals()
        known = {name for _, name in allowed}
        allowed += [(type(name, (ForeignObject,), {"global_name": name}), name)
                    for name in _unknown_globals(path) if name not in known]
    try:
        with torch.serialization.safe_globals(allowed):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(_could_run_code(path, _unknown_globals(path), "", error)) from None
    except (RuntimeError, OSError, EOFError, ValueError) as error:
        raise CheckpointError(f"{path} is not a readable torch checkpoint (damaged or "
                              f"truncated?): {str(error).splitlines()[0]}") from None
    return data


def _numpy_globals() -> list[tuple[Callable[..., Any], str]]:
    """numpy's array and dtype constructors under the names its pickles use (numpy 1 and 2):
    data constructors, which torch's weights_only documentation allowlists for numpy arrays.
    Generator states in a client state (Megatron-DeepSpeed's `np_rng_state`) stay arrays."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    dtypes = [(cls, f"numpy.dtypes.{name}") for name, cls in vars(numpy.dtypes).items()
              if isinstance(cls, type) and issubclass(cls, numpy.dtype)]
    return [(_reconstruct, "numpy._core.multiarray._reconstruct"),
            (_reconstruct, "numpy.core.multiarray._reconstruct"),
            (numpy.ndarray, "numpy.ndarray"), (numpy.dtype, "numpy.dtype"), *dtypes]


def _could_run_code(path: Path, names: list[str], where: str, error: object = "") -> str:
    found = ", ".join(f"global {name} is not allowed" for name in names) or error
    return (f"{path} holds objects that could run code when loaded ({found}{where}); zeromem "
            "reads DeepSpeed checkpoints only with the few DeepSpeed classes they need, never "
            "arbitrary globals")


def _unknown_globals(path: Path) -> list[str]:
    allowed = {name for _, name in _SAFE_GLOBALS}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - the load that follows reports the damage
        return []
    return [name for name in found if name not in allowed]


def _first_foreign(value: object) -> ForeignObject | None:
    if isinstance(value, ForeignObject):
        return value
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        return next((f for f in map(_first_foreign, value) if f is not None), None)
    return None


def need(data: dict, key: str, path: Path) -> Any:
    if key not in data:
        raise CheckpointError(f"{path} is damaged or not a DeepSpeed ZeRO checkpoint: it has no "
                              f"{key!r} (keys: {sorted(map(str, data))[:10]})")
    return data[key]
