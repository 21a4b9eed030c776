"""zeromem checkpoints as one torch file an FSDP2 run resumes from: the way back of
`torch_import.py`.

    zeromem consolidate checkpoints/ step-1000.pt --optimizer

writes, with `torch.save`, the layout torch's `get_state_dict` gives with full state dicts:

    {"model": {key: tensor},
     "optimizer": {"state": {name: {"exp_avg": t, "exp_avg_sq": t, "step": t}},
                   "param_groups": [{"lr": ..., ..., "params": [name, ...]}]}}

which an FSDP2 script loads with `set_state_dict(model, optimizer, model_state_dict=...,
optim_state_dict=..., options=StateDictOptions(full_state_dict=True))`, and torch's
`torch_save_to_dcp` turns into a DCP directory. Parameters are the fp32 masters, tied keys
one tensor; per-element optimizer states have their parameter's shape, scalar ones (Adam's
step) are as saved; each group lists its trained parameters in the model's order, with the
options the run had, less zeromem's implementation switches (`fused`, `foreach`: the
loading optimizer keeps its own). Everything is read into memory: the model's states once.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch

from zeromem.checkpoints.consolidate import (checkpoint_tensors, decode, output_keys,
                                             pieces_by_param, read_whole)
from zeromem.checkpoints.deepspeed_options import IMPLEMENTATION
from zeromem.checkpoints.tensor_files import SafetensorsReader, TensorSpec


def export_torch_state(ckpt_dir: str | os.PathLike, out_path: str | os.PathLike,
                       tag: str | None = None) -> str:
    """Write the checkpoint's model and optimizer state to `out_path` (module docstring);
    no process group. Every file is checked against its checksum first. Returns `out_path`."""
    with checkpoint_tensors(ckpt_dir, tag) as (path, manifest, spec_of), ExitStack() as files:
        model = _model(path, manifest, spec_of)
        optimizer = {"state": _states(manifest, _readers(path, files)),
                     "param_groups": _groups(manifest)}
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        torch.save({"model": model, "optimizer": optimizer}, tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return str(out)


def _model(path: Path, manifest: dict, spec_of: Callable[[str], TensorSpec]
           ) -> dict[str, torch.Tensor]:
    keys, aliases = output_keys(manifest, False, path), manifest["aliases"]
    whole = {key: read_whole(spec_of(key)) for key in keys if key not in aliases}
    return {key: whole[aliases.get(key, key)] for key in keys}


def _readers(path: Path, files: ExitStack) -> Callable[[str], SafetensorsReader]:
    """One reader per rank file, opened when first asked for, closed with `files`."""
    open_files: dict[str, SafetensorsReader] = {}

    def reader(name: str) -> SafetensorsReader:
        if name not in open_files:
            open_files[name] = files.enter_context(SafetensorsReader(path / name))
        return open_files[name]
    return reader


def _states(manifest: dict, reader: Callable[[str], SafetensorsReader]) -> dict[str, dict]:
    """Each trained parameter's optimizer states, whole, in its shape."""
    saved, out = manifest["optimizer"]["tensor_states"], {}
    for name, pieces in pieces_by_param(manifest).items():
        info = manifest["params"][name]
        state = decode(info["scalar_state"])
        for kind in info.get("tensor_states", saved):
            dtype = getattr(torch, manifest["dtypes"]["optimizer"][kind])
            # the pieces tile it (pieces_by_param checks): zeros only keep a wrong tiling
            # from showing stale memory, which may hold the right values by chance
            whole = torch.zeros(torch.Size(info["shape"]).numel(), dtype=dtype)
            for p in pieces:
                reader(p.file).read(f"optimizer/{kind}/{name}", 0, p.numel,
                                    out=whole[p.offset:p.offset + p.numel])
            state[kind] = whole.view(info["shape"])
        out[name] = state
    return out


def _groups(manifest: dict) -> list[dict]:
    """The param groups' options and their parameters' names, in the model's order."""
    params = manifest["params"]
    order = [k for k in manifest["state_dict_keys"] if k in params]
    return [{**{k: v for k, v in decode(options).items() if k not in IMPLEMENTATION},
             "params": [n for n in order if params[n]["param_group"] == i]}
            for i, options in enumerate(manifest["optimizer"]["param_groups"])]
