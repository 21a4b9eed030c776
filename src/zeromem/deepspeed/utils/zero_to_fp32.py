"""DeepSpeed's `deepspeed.utils.zero_to_fp32`: a ZeRO checkpoint as one fp32 state dict.

Reads zeromem checkpoints and DeepSpeed's own (stages 1-3: imported into a temporary
directory first, checkpoints/deepspeed_import.py), with no process group and no GPU;
keys are the trained module's `state_dict()` keys, trained parameters from the fp32
masters, tied keys one tensor. `checkpoint_dir` is the directory saved into (holding
`latest` and the tag directories); `tag` defaults to what `latest` names.

As a command, the one DeepSpeed copies into each checkpoint as `zero_to_fp32.py`
(`zeromem.deepspeed.utils.zero_to_torch`: its `zero_to_torch.py`, `--dtype` required);
`save_checkpoint` writes both into the directory saved into, as DeepSpeed does:

    python CHECKPOINT_DIR/zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR
        [--max_shard_size 5GB] [--safe_serialization] [-t TAG] [--dtype bf16]
    python -m zeromem.deepspeed.utils.zero_to_fp32 ...   (the same)

`get_optim_files(dir)` and `get_model_state_file(dir, zero_stage)` name the files of one
tag directory that Lightning's `convert_zero_checkpoint_to_fp32_state_dict` reads beside
the state dict: the ZeRO stage from the first optimizer file, and the client state
(Lightning's loops, callbacks and hyper-parameters) from the model-states file.
DeepSpeed's checkpoints have both; a zeromem checkpoint answers with its checked
`client_state.pt` and, for the stage, which its manifest keeps, one in-memory file.

`exclude_frozen_parameters=True` (`--exclude_frozen_parameters`) gives the trained
parameters and the buffers only, as DeepSpeed's does: a LoRA run's adapters without the base
model. `lazy_mode=True` gives `LazyTensor`s that read a tensor when its `contiguous()` is
called; `to_torch_tensor` reads them all.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import weakref
from contextlib import ExitStack
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from ...checkpoints.consolidate import (CLIENT_STATE, checkpoint_tensors, output_keys, raise_problems,
                                        read_manifest, read_state_dict, read_whole, verify_file)
from ...checkpoints.deepspeed_import import readable
from ...checkpoints.hf_export import cast_spec, named_dtype, parse_shard_size, plan_shards
from ...checkpoints.tensor_files import TensorSpec, write_output


class LazyTensor:
    """One tensor of a checkpoint, read from its files only when asked: DeepSpeed's
    `lazy_mode` pseudo tensor, with its `shape`, `dtype` and `contiguous()`."""

    def __init__(self, spec: TensorSpec, files: _OpenFiles):
        self.shape, self.dtype = torch.Size(spec.shape), spec.dtype
        self._spec = spec
        self._files = files  # open while a lazy tensor refers to them

    def contiguous(self) -> torch.Tensor:
        """The tensor, read whole (fp32 for floating ones) into memory on the CPU."""
        return read_whole(self._spec)

    def __repr__(self) -> str:
        return f"LazyTensor({self._spec.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


class _OpenFiles:
    """A checked checkpoint's files (and, for DeepSpeed's, the temporary directory it was
    imported into), closed once no lazy tensor refers to them, or at exit."""

    def __init__(self, stack: ExitStack):
        weakref.finalize(self, stack.close)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike,
                                             tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False
                                             ) -> dict[str, torch.Tensor] | dict[str, LazyTensor]:
    """The checkpoint's full fp32 state dict, in memory on the CPU; without frozen
    parameters with `exclude_frozen_parameters` (buffers and trained parameters, as
    DeepSpeed's); with `lazy_mode`, `LazyTensor`s that read each tensor when asked
    (`to_torch_tensor` reads them all)."""
    if lazy_mode:
        return _lazy_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    return _state_dict(checkpoint_dir, tag, exclude_frozen_parameters)


def _state_dict(checkpoint_dir: str | os.PathLike, tag: str | None,
                exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    with readable(checkpoint_dir, tag) as (source, source_tag):
        return read_state_dict(source, source_tag, exclude_frozen)


def _lazy_state_dict(checkpoint_dir: str | os.PathLike, tag: str | None,
                     exclude_frozen: bool) -> dict[str, LazyTensor]:
    with ExitStack() as stack:
        source, source_tag = stack.enter_context(readable(checkpoint_dir, tag))
        path, manifest, spec_of = stack.enter_context(checkpoint_tensors(source, source_tag))
        keys, aliases = output_keys(manifest, exclude_frozen, path), manifest["aliases"]
        files = _OpenFiles(stack.pop_all())  # checked; they stay open from here on
    lazy = {key: LazyTensor(spec_of(key), files) for key in keys if key not in aliases}
    return {key: lazy[aliases.get(key, key)] for key in keys}  # tied keys: one object


def to_torch_tensor(state_dict: Mapping[str, torch.Tensor | LazyTensor], return_empty_tensor: bool = False,
                    dtype: str | torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """DeepSpeed's: every `LazyTensor` (or tensor) read whole, tied keys one tensor;
    floating ones cast to `dtype` (bf16, fp16 or fp32) if given; `return_empty_tensor`:
    uninitialised tensors of the right shapes and dtypes instead, to size a conversion."""
    out_dtype = None if dtype is None else named_dtype(dtype, "dtype")
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for key, value in state_dict.items():
        if id(value) in first:
            out[key] = out[first[id(value)]]
            continue
        first[id(value)] = key
        cast = out_dtype if out_dtype is not None and value.dtype.is_floating_point else value.dtype
        if return_empty_tensor:
            out[key] = torch.empty(value.shape, dtype=cast)
        else:
            out[key] = value.contiguous().to(cast)
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> nn.Module:
    """Move `model` to the CPU and load the checkpoint's fp32 weights into it (not strict,
    as DeepSpeed's); returns `model`."""
    state = _state_dict(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike,
                                               output_dir: str | os.PathLike,
                                               max_shard_size: str | int = "5GB",
                                               safe_serialization: bool = False,
                                               tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """`convert_zero_checkpoint_to_state_dict` in fp32."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32,
                                          max_shard_size, safe_serialization, tag,
                                          exclude_frozen_parameters)


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | os.PathLike,
                                          output_dir: str | os.PathLike,
                                          dtype: str | torch.dtype = torch.float32,
                                          max_shard_size: str | int = "5GB",
                                          safe_serialization: bool = False,
                                          tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> None:
    """Write the state dict into `output_dir` as `save_pretrained` names it:
    `pytorch_model.bin` (`model.safetensors` with `safe_serialization`), or past
    `max_shard_size` numbered shards and their `.index.json`; floating tensors in `dtype`
    (fp32, fp16 or bf16, by name or torch dtype, as DeepSpeed 0.19.8 takes it), trained
    parameters cast once from the fp32 masters. Tensors stream a chunk at a time, so
    memory stays bounded whatever the model's size."""
    out_dtype = named_dtype(dtype, "dtype")
    max_bytes = parse_shard_size(max_shard_size)
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    out = Path(output_dir)
    with readable(checkpoint_dir, tag) as (source, source_tag), \
            checkpoint_tensors(source, source_tag) as (path, manifest, spec_of):
        keys, aliases = output_keys(manifest, exclude_frozen_parameters, path), manifest["aliases"]
        specs = {key: cast_spec(spec_of(key), key, out_dtype) for key in keys if key not in aliases}
        shards = plan_shards([(key, s.nbytes) for key, s in specs.items()], max_bytes)
        files = _shard_names(name, len(shards))
        weight_map = {}
        for file, keys in zip(files, shards):
            tied = {k: v for k, v in aliases.items() if v in keys}
            write_output(out / file, [specs[k] for k in keys], keys + list(tied), tied)
            weight_map.update({k: file for k in keys + list(tied)})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs.values())},
                 "weight_map": weight_map}
        (out / f"{name}.index.json").write_text(json.dumps(index, indent=2) + "\n")


def get_optim_files(checkpoint_dir: str | os.PathLike) -> list[str | io.BytesIO]:
    """DeepSpeed's `*_optim_states.pt` files of tag directory `checkpoint_dir`, in rank
    order; for a zeromem checkpoint, one in-memory file holding what Lightning reads from
    them, `{"optimizer_state_dict": {"zero_stage": ..., "partition_count": ...}}`."""
    directory = Path(checkpoint_dir)
    found = sorted(directory.glob("*_optim_states.pt"),
                   key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
    if found:
        return [str(p) for p in found]
    manifest = read_manifest(directory)
    return [_in_memory({"optimizer_state_dict": {"zero_stage": manifest["zero_stage"],
                                                 "partition_count": manifest["world_size"]}})]


def get_model_state_file(checkpoint_dir: str | os.PathLike, zero_stage: int) -> str | io.BytesIO:
    """DeepSpeed's rank-0 model-states file of tag directory `checkpoint_dir`; for a
    zeromem checkpoint its client state, checked against the manifest (an empty dict in
    memory when none was saved)."""
    directory = Path(checkpoint_dir)
    name = ("zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage == 3
            else "mp_rank_00_model_states.pt")
    if (directory / name).is_file():
        return str(directory / name)
    saved = read_manifest(directory)["client_state"]
    if saved is None:
        return _in_memory({})
    raise_problems(directory, [saved], [verify_file(directory / CLIENT_STATE, saved["sha256"],
                                                    saved["bytes"])])
    return str(directory / CLIENT_STATE)


def _in_memory(value: dict) -> io.BytesIO:
    """A file `torch.load` reads as `value` (plain data: also with weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _shard_names(name: str, count: int) -> list[str]:
    """HF's names: `pytorch_model.bin`, or `pytorch_model-00001-of-00003.bin`, ..."""
    if count == 1:
        return [name]
    stem, dot, suffix = name.partition(".")
    return [f"{stem}-{i:05d}-of-{count:05d}{dot}{suffix}" for i in range(1, count + 1)]


def main(argv: list[str] | None = None, dtype_required: bool = False) -> None:
    """DeepSpeed's `zero_to_fp32.py` command line (its arguments, `--debug` accepted); with
    `dtype_required`, its `zero_to_torch.py` one, which adds `--dtype`."""
    parser = argparse.ArgumentParser(description="a ZeRO checkpoint as state dict files")
    parser.add_argument("checkpoint_dir", help="the directory saved into (holding `latest`)")
    parser.add_argument("output_dir", help="where the state dict files go")
    parser.add_argument("--dtype", required=dtype_required, default="fp32",
                        help="floating tensors' dtype: fp32, fp16 or bf16 (zero_to_torch.py)")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_state_dict(
        args.checkpoint_dir, args.output_dir, args.dtype, max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters)


__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "to_torch_tensor", "LazyTensor",
           "convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_optim_files", "get_model_state_file"]


if __name__ == "__main__":
    main()
