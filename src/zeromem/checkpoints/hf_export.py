"""`zeromem consolidate --hf`: a checkpoint written as a Hugging Face model directory.

`export_hf(ckpt_dir, config_dir, out_dir)` turns a zeromem checkpoint of any stage,
world size and precision (or a DeepSpeed ZeRO checkpoint, imported first into a
temporary directory) into what `save_pretrained` writes and `from_pretrained`
reads: `config.json` and safetensors, one `model.safetensors` or, past
`max_shard_size`, `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`.
No process group, no GPU: tensors stream a chunk at a time through
`consolidate.checkpoint_tensors`, so memory stays bounded by CHUNK_BYTES.

What the config's model expects is read from the model built on the meta device (no
memory, no weights; the config is read from local files with `trust_remote_code`
off, so nothing in the directory runs). Decisions:

- Names. The checkpoint's keys are its module's `state_dict()` keys. A wrapper around
  the HF model (DDP's `module.`, torch.compile's `_orig_mod.`, a user's `self.model`)
  prefixes every key; the shortest prefix of whole dotted components, common to all
  keys, whose removal gives exactly the config's names is removed.
- Tied weights. A tensor the model shares between names (GPT-2's `lm_head.weight` is
  `transformer.wte.weight`) is written once, as `save_pretrained` does: the names
  transformers ties back on load (`all_tied_weights_keys`' targets) are left out and
  their source is written. The checkpoint must hold such names as one tensor (its
  `aliases`); two separately trained tensors are refused, since the load would
  silently replace one by the other. Names the model shares but does not declare
  tied are each written.
- Dtype. Floating tensors are written in `dtype`; by default the config's `dtype`
  (`torch_dtype` in older configs) when set, else the checkpoint's training (compute)
  dtype. Trained parameters are the fp32 masters, cast once. `config.json` records
  the dtype written and the model class.
- Checks first. Every name and shape is compared to the config's model before anything
  is written, and the first mismatching key is named. Files go to `.tmp-hf-<name>`
  beside `out_dir`, renamed into place when complete; a non-empty `out_dir` is refused.
- Shards. Tensors in the model's `state_dict()` order, packed as huggingface_hub packs
  them: a new shard when the next tensor would pass `max_shard_size`, a larger tensor
  alone in a shard of its own. The index's metadata has `total_size` (bytes written)
  and `total_parameters`.

Not covered: models whose files transformers converts on load (its weight converters,
e.g. fused MoE experts) are written in their in-memory layout.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeromem.checkpoints.consolidate import checkpoint_tensors, fsync_dir
from zeromem.checkpoints.tensor_files import CheckpointError, TensorSpec, write_safetensors
from zeromem.leftovers import OWNER, reclaim_stale, write_owner

log = logging.getLogger("zeromem")

__all__ = ["export_hf", "read_hf_model", "plan_shards", "DEFAULT_MAX_SHARD_SIZE"]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's; transformers 5's save_pretrained uses 50GB
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Besides the weights: what makes the directory usable as it was (never code, never weights).
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
              "vocab.txt", "tokenizer.model", "chat_template.jinja")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class HfModel:
    """What `from_pretrained` of a config expects, read off the model built on meta."""

    config: Any
    class_name: str
    shapes: dict[str, tuple[int, ...]]  # every state_dict key, in state_dict order
    tied: dict[str, str]                # name left out on save -> the name written instead
    num_parameters: int

    @property
    def written(self) -> list[str]:
        return [name for name in self.shapes if name not in self.tied]


def read_hf_model(config_dir: str | os.PathLike) -> HfModel:
    """The model `config_dir` (a directory with config.json, or that file) describes."""
    import transformers

    path = Path(config_dir)
    directory = path.parent if path.is_file() else path
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{config_dir}: no config.json; --hf takes the directory of a "
                              "Hugging Face model (or its config.json)")
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True,
                                                         trust_remote_code=False)  # no prompt
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{directory / 'config.json'} cannot be read as a Hugging Face "
                              f"config: {error}") from None
    with torch.device("meta"):
        model = _build(transformers, config, directory)
    state = model.state_dict(keep_vars=True)
    num_parameters = sum(p.numel() for p in model.parameters())  # tied ones once
    return HfModel(config, type(model).__name__, {k: tuple(v.shape) for k, v in state.items()},
                   _tied_names(model, state), num_parameters)


def _build(transformers: Any, config: Any, directory: Path) -> torch.nn.Module:
    """The config's `architectures[0]` class if transformers has it, else a causal LM."""
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    try:
        if isinstance(cls, type):
            return cls(config)
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"{directory / 'config.json'}: cannot build the model it "
                              f"describes ({error}); set \"architectures\" to a transformers "
                              "model class") from None


def _tied_names(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name save_pretrained leaves out: name written} over names sharing one tensor."""
    targets = set(getattr(model, "all_tied_weights_keys", None) or {})  # re-tied on load
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    tied = {}
    for names in groups.values():
        kept = [n for n in names if n not in targets] or names[:1]
        tied.update({n: kept[0] for n in names if n not in kept})
    return tied


# ---------------------------------------------------------------- matching the checkpoint

def checkpoint_shapes(manifest: dict) -> dict[str, tuple[int, ...]]:
    """Every state_dict key of a checkpoint (aliases included) -> its shape."""
    def shape(key: str) -> tuple[int, ...]:
        canonical = manifest["aliases"].get(key, key)
        entry = manifest["params"].get(canonical) or manifest["module_tensors"].get(canonical)
        if entry is None:
            raise CheckpointError(f"manifest lists state_dict key {key!r} but holds no tensor "
                                  "for it")
        return tuple(entry["shape"])
    return {key: shape(key) for key in manifest["state_dict_keys"]}


def common_prefixes(keys: list[str]) -> list[str]:
    """"", then each longer run of whole dotted components that every key starts with."""
    if not keys:
        return [""]
    parts = keys[0].split(".")[:-1]
    prefixes = [""]
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i]) + "."
        if not all(k.startswith(prefix) for k in keys):
            break
        prefixes.append(prefix)
    return prefixes


def strip_prefix(keys: list[str], expected: set[str]) -> str:
    """The wrapper prefix to remove from `keys`: the shortest giving exactly `expected`,
    else (for the error) the one matching most names."""
    prefixes = common_prefixes(keys)
    for prefix in prefixes:
        if {k[len(prefix):] for k in keys} == expected:
            return prefix
    return max(prefixes, key=lambda p: len({k[len(p):] for k in keys} & expected))


def match_checkpoint(manifest: dict, model: HfModel, source: Path,
                     config_dir: str | os.PathLike) -> dict[str, str]:
    """{name to write: canonical checkpoint key}, or CheckpointError naming the first
    key whose name, shape or tying does not fit the config's model."""
    shapes = checkpoint_shapes(manifest)
    prefix = strip_prefix(list(shapes), set(model.shapes))
    aliases = manifest["aliases"]

    def canonical(name: str) -> str:
        return aliases.get(prefix + name, prefix + name)
    ours = {k[len(prefix):]: shape for k, shape in shapes.items()}
    problems = _mismatches(ours, model, prefix)
    problems += [f"the model ties {name!r} to {kept!r} (tie_word_embeddings), but the "
                 "checkpoint holds them as two tensors; set tie_word_embeddings to false in "
                 "the config" for name, kept in model.tied.items()
                 if not problems and canonical(name) != canonical(kept)]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {source} does not fit the {model.class_name} of "
                              f"{config_dir}: {problems[0]}{more}; nothing was written")
    return {name: canonical(name) for name in model.written}


def _mismatches(ours: dict[str, tuple[int, ...]], model: HfModel, prefix: str) -> list[str]:
    """Names and shapes that differ, in the model's state_dict order, then extra keys."""
    problems = []
    for name, shape in model.shapes.items():
        if name not in ours:
            problems.append(f"the model has {name!r}, the checkpoint has no {prefix + name!r}")
        elif ours[name] != shape:
            problems.append(f"{prefix + name!r} has shape {list(ours[name])} in the checkpoint, "
                            f"the model's {name!r} has {list(shape)}")
    return problems + [f"the checkpoint has {prefix + name!r}, which the model has not"
                       for name in ours if name not in model.shapes]


def output_dtype(requested: str | None, config: Any, manifest: dict) -> torch.dtype:
    """`--dtype`, else the config's dtype when set, else the checkpoint's training dtype."""
    if requested:
        return named_dtype(requested, "--dtype")
    configured = getattr(config, "dtype", None)  # transformers reads torch_dtype into it
    if configured is not None and configured != "auto":
        return named_dtype(configured, "the config's dtype")
    return named_dtype(manifest["dtypes"]["compute"], "the checkpoint's compute dtype")


def named_dtype(value: str | torch.dtype, what: str) -> torch.dtype:
    """bf16, fp16 or fp32: a torch dtype, or a name as DeepSpeed writes them ("torch." allowed)."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"{what} is {value!r}; write bf16, fp16 or fp32")
    return DTYPES[name]


# ---------------------------------------------------------------- shards

def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names per shard, in order: a new shard when the next tensor would pass `max_bytes`;
    a tensor larger than that in a shard of its own, placed where it came."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, nbytes in sizes:
        if nbytes > max_bytes:
            shards.append([name])
            continue
        if current and current_bytes + nbytes > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_files(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def parse_shard_size(size: str | int) -> int:
    """HF's "5GB" (10^9) or "5GiB" (2^30); a bare number is bytes."""
    from zeromem.planning.estimate import parse_bytes

    nbytes = int(parse_bytes(size, "B"))
    if nbytes <= 0:
        raise CheckpointError(f"--max-shard-size {size!r} must be positive")
    return nbytes


# ---------------------------------------------------------------- export

def export_hf(ckpt_dir: str | os.PathLike, config_dir: str | os.PathLike,
              out_dir: str | os.PathLike, tag: str | None = None, dtype: str | None = None,
              max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> str:
    """Write checkpoint `ckpt_dir` (zeromem, or DeepSpeed ZeRO) as a `from_pretrained`
    directory `out_dir` for the model of `config_dir`; returns `out_dir`.

    No process group. Refused, with nothing written: a non-empty `out_dir`, and a
    checkpoint whose names or shapes differ from the config's model (the first
    mismatching key is named). See the module docstring for names, tied weights,
    dtype and shards.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory; choose a new "
                              "output directory")
    max_bytes = parse_shard_size(max_shard_size)
    model = read_hf_model(config_dir)
    from zeromem.checkpoints.deepspeed_import import readable

    with readable(ckpt_dir, tag) as (source, source_tag):
        return _export(source, source_tag, model, config_dir, out, dtype, max_bytes)


def _export(ckpt_dir: str | os.PathLike, tag: str | None, model: HfModel,
            config_dir: str | os.PathLike, out: Path, dtype: str | None, max_bytes: int) -> str:
    with checkpoint_tensors(ckpt_dir, tag) as (path, manifest, spec_of):
        names = match_checkpoint(manifest, model, path, config_dir)
        out_dtype = output_dtype(dtype, model.config, manifest)
        specs = [cast_spec(spec_of(key), name, out_dtype) for name, key in names.items()]
        shards = plan_shards([(s.name, s.nbytes) for s in specs], max_bytes)
        _write_directory(out, specs, shards, model, out_dtype, config_dir)
    log.info("wrote %s (%d shard(s), %s) from checkpoint %s", out, len(shards), out_dtype, path)
    return str(out)


def cast_spec(spec: TensorSpec, name: str, dtype: torch.dtype) -> TensorSpec:
    """`spec` renamed to `name`, floating tensors cast chunk by chunk to `dtype`."""
    if not spec.dtype.is_floating_point:
        return TensorSpec(name, spec.dtype, spec.shape, spec.chunks)
    return TensorSpec(name, dtype, spec.shape, lambda: (c.to(dtype) for c in spec.chunks()))


def _write_directory(out: Path, specs: list[TensorSpec], shards: list[list[str]],
                     model: HfModel, dtype: torch.dtype, config_dir: str | os.PathLike) -> None:
    """Every file into `.tmp-hf-<name>`, then one rename to `out`."""
    tmp = out.parent / f".tmp-hf-{out.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    reclaim_stale(out.parent, tmp.name)  # left by an export that was killed
    if tmp.exists():
        raise CheckpointError(f"{tmp} exists: another export into {out} is running")
    tmp.mkdir()
    write_owner(tmp)
    try:
        by_name = {s.name: s for s in specs}
        weight_map = {}
        for file, names in zip(shard_files(len(shards)), shards):
            write_safetensors(tmp / file, [by_name[n] for n in names], {"format": "pt"})
            weight_map.update({n: file for n in names})
        if len(shards) > 1:
            index = {"metadata": {"total_parameters": model.num_parameters,
                                  "total_size": sum(s.nbytes for s in specs)},
                     "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _write_config(tmp, model, dtype)
        _copy_side_files(Path(config_dir), tmp)
        (tmp / OWNER).unlink()
        os.rename(tmp, out)  # onto nothing or an empty directory
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_config(directory: Path, model: HfModel, dtype: torch.dtype) -> None:
    """config.json as save_pretrained writes it: the dtype written and the model class."""
    model.config.dtype = str(dtype).removeprefix("torch.")
    model.config.architectures = [model.class_name]
    model.config.save_pretrained(directory)


def _copy_side_files(config_dir: Path, directory: Path) -> None:
    source = config_dir.parent if config_dir.is_file() else config_dir
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
