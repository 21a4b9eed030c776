"""DeepSpeed checkpoints (ZeRO stages 0-3) turned into zeromem checkpoints.

(Stage 0, DeepSpeed's default, keeps its optimizer state by position in the model states
file: `deepspeed_stage0.py` reads it.)

DeepSpeed's layout, as its `save_checkpoint` writes it (one model-parallel rank):

    <dir>/latest                                         text: the tag
    <dir>/<tag>/mp_rank_00_model_states.pt               stages 1-2: module state dict, param
                                                          shapes per param group, counters,
                                                          lr scheduler, ds_config
    <dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3, one per rank: the same,
                                                          frozen parameters as partitions
    <dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one per data-parallel rank:
                                                          its fp32 partition and Adam states

How the partitions tile the parameters:

- stages 1-2: per param group, rank r holds elements [r * P, (r + 1) * P) of the group's
  flat buffer (parameters packed in `param_shapes` order, padding only at the end). The
  fp32 partition is saved without padding; the optimizer states with it.
- stage 3: every parameter is partitioned on its own into world-size pieces of
  ceil(numel / world size) elements (the last padded); rank r's flat buffer is its
  piece of each parameter in `param_shapes` order, over all groups.

A universal checkpoint (DeepSpeed's `ds_to_universal`, tag directory `<tag>_universal`)
keeps the same model states files and, instead of the per-rank optimizer files, each
trained parameter's full states:

    <tag>/zero/<name>/fp32.pt, exp_avg.pt, ...       the whole tensor ({"param": it, ...}
                                                      at stages 1-2)
    <tag>/zero/<name>/step.pt                         stages 1-2: its optimizer step
    <tag>/zero/optimizer_state.pt                     the optimizer's options, loss scaler
                                                      and ZeRO stage; at stage 3 rank 0's
                                                      whole optimizer file (its step)

fp16 runs: every optimizer file holds the ZeRO optimizer's loss scaler (`loss_scaler`,
a pickled DeepSpeed `DynamicLossScaler` or static `LossScaler`), the same on every rank;
its scale, hysteresis and step counts become zeromem's scaler state (`precision.py`
names the correspondence), so the run resumes at DeepSpeed's scale. Checkpoints saved
with `exclude_frozen_parameters=True` lack the frozen parameters in the module state;
the import marks them `frozen_parameters_excluded` and a load keeps the model's own.

The import assembles each parameter's full fp32 master and optimizer states and writes
them as a one-rank zeromem checkpoint (one piece per parameter, `checkpoints/save_load.py`),
which the ordinary loader then reads at any world size and stage. The learning-rate
schedule continues where DeepSpeed's stopped: DeepSpeed's `last_batch_iteration` i
(-1 before its first step) is zeromem's `last_epoch` i + 1 (`optim/schedulers.py`).

Loading runs no code from the files (`deepspeed_pickles.py`); a checkpoint's client state
comes back as DeepSpeed's `load_checkpoint` returns it (`DeepSpeedState.client_state`).
"""
from __future__ import annotations

import logging
import math
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from zeromem.checkpoints.consolidate import FORMAT, VERSION, encode, write_one_rank
from zeromem.checkpoints.deepspeed_offloaded import swapped_in
from zeromem.checkpoints.deepspeed_options import optimizer_and_schedule
from zeromem.checkpoints.deepspeed_pickles import LossScalerRecord, load_object, load_pt, need
from zeromem.checkpoints.deepspeed_stage0 import (ParamOrder, assemble_stage0, module_weights,
                                                  scalar_states, tied_keys)
from zeromem.checkpoints.formats import deepspeed_location, describe_directory, is_universal
from zeromem.checkpoints.tensor_files import CheckpointError, TensorSpec

if TYPE_CHECKING:
    from zeromem.training_state import TrainingState

log = logging.getLogger("zeromem")

__all__ = ["import_deepspeed", "read_deepspeed"]


# ---------------------------------------------------------------- the checkpoint, assembled

@dataclass(frozen=True)
class LoadingEngine:
    """What the engine loading a DeepSpeed checkpoint knows that the files do not say."""

    param_order: ParamOrder  # stage 0: what the optimizer states are numbered by
    # A config without an optimizer block: DeepSpeed stepped the script's own, which the
    # files keep the states and options of, not the class. The engine's optimizer's kind,
    # and the options its param groups hold (DeepSpeed's CPU Adam, which Accelerate swaps
    # in, keeps a bias_correction the engine's does not; empty: keep every one)
    optimizer_type: str
    option_keys: frozenset[str] = frozenset()
    # Whether the load reads the optimizer states: without them, a stage-0 checkpoint
    # whose positions are not the engine's order still gives its module's weights
    # (DeepSpeed's load_module_only, a warm start under other param groups)
    optimizer_states: bool = True

    @classmethod
    def of(cls, state: TrainingState, optimizer_states: bool) -> LoadingEngine:
        groups = state.optimizer.param_groups
        return cls(state.param_order, state.optimizer_type,
                   frozenset(groups[0]) - {"params"} if groups else frozenset(), optimizer_states)


@dataclass
class DeepSpeedState:
    """A DeepSpeed ZeRO checkpoint with every parameter's state whole, in fp32."""

    path: Path
    stage: int
    world_size: int
    params: dict[str, dict[str, torch.Tensor]]  # name -> {"master", "exp_avg", ...}, full shape
    param_group: dict[str, int]                 # name -> optimizer param group
    scalars: list[dict[str, Any]]               # per param group: Adam's step, ...
    param_groups: list[dict[str, Any]]          # per param group: lr, betas, ... as saved
    module_tensors: dict[str, torch.Tensor]     # buffers and frozen parameters
    state_dict_keys: list[str]
    aliases: dict[str, str]                     # tied weights: other key -> parameter name
    loss_scaler: dict[str, Any]                 # the attributes of DeepSpeed's loss scaler
    model_states: dict = field(repr=False)      # rank 0's model states file (counters, config)
    engine: LoadingEngine | None = None         # what the loading engine told the import

    def client_state(self) -> dict[str, Any]:
        """What DeepSpeed's `load_checkpoint` returns as client state: the model states keys
        it does not keep for itself, `save_checkpoint`'s client_state among them."""
        return {k: v for k, v in self.model_states.items() if k not in _DEEPSPEED_OWN}


# the model states keys DeepSpeed's load_checkpoint (0.19.8) keeps out of the client state
_DEEPSPEED_OWN = frozenset({"module", "skipped_steps", "global_steps", "dp_world_size",
                            "mp_world_size", "data_sampler", "random_ltd", "lr_scheduler",
                            "optimizer"})
# the model states keys the import reads: no ForeignObject may stand in them
_MODEL_KEYS = ("module", "optimizer", "buffer_names", "param_shapes", "frozen_param_shapes", "shared_params",
               "lr_scheduler", "ds_config", "global_steps", "global_samples", "skipped_steps",
               "dp_world_size", "mp_world_size")


def read_deepspeed(load_dir: str | os.PathLike, tag: str | None = None,
                   universal: bool = False, engine: LoadingEngine | None = None) -> DeepSpeedState:
    """Read the DeepSpeed checkpoint at `load_dir` whole (tag: `tag`, else the one `latest`
    names, or `latest_universal` if `universal`; see `formats.deepspeed_location`).

    `engine`: what the engine that loads it knows (without one: the module's parameters in
    one group, and the client optimizer's kind told from its options)."""
    where = deepspeed_location(load_dir, tag, universal)
    if where is None:
        raise CheckpointError(describe_directory(load_dir))
    path = where[0] / where[1]
    model_file = path / "mp_rank_00_model_states.pt"
    stage3 = not model_file.is_file()
    model = load_pt(path / "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage3 else model_file,
                    read=_MODEL_KEYS)
    world_size = model.get("dp_world_size", 1)
    if model.get("mp_world_size", 1) != 1:
        raise CheckpointError(f"{path}: saved with model (tensor) parallelism "
                              f"{model['mp_world_size']}; the import reads mp_world_size 1 only")
    universal_layout = is_universal(path)
    if not stage3 and not universal_layout and model.get("optimizer") is not None:
        return _read_stage0(path, model, engine)
    if universal_layout:
        optim_files = [path / "zero" / "optimizer_state.pt"]
        optims = [load_pt(optim_files[0])]
    else:
        optim_files = _optim_files(path, world_size)
        optims = [need(load_pt(f), "optimizer_state_dict", f) for f in optim_files]
    stage = int(need(optims[0], "zero_stage", optim_files[0]))
    if (stage == 3) != stage3:
        raise CheckpointError(f"{path}: optimizer files say ZeRO stage {stage} but the model "
                              f"states are laid out for stage {3 if stage3 else '1-2'}")
    shapes = [dict(group) for group in need(model, "param_shapes", path / "model_states")]
    if universal_layout:
        params, scalars, groups = _assemble_universal(path, optims[0], shapes, stage)
        frozen = _frozen_stage3(path, model, world_size) if stage3 else {}
    elif stage3:
        params, scalars, groups = _assemble_stage3(path, optims, shapes, world_size)
        frozen = _frozen_stage3(path, model, world_size)
    else:
        params, scalars, groups = _assemble_stage12(path, optims, shapes, optim_files)
        frozen = {}
    module = dict(need(model, "module", path / "model_states"))
    shared = dict(model.get("shared_params") or {})
    owner = _stage3_owners(path, optims[0], len(shapes)) if stage3 else range(len(shapes))
    param_group = {name: owner[i] for i, group in enumerate(shapes) for name in group}
    module_tensors = {k: v for k, v in module.items() if k not in param_group and k not in shared}
    module_tensors.update(frozen)
    keys, shared = _without_excluded_ties(list(module), shared, param_group, module_tensors)
    return DeepSpeedState(path, stage, world_size, params, param_group, scalars, groups,
                          module_tensors, keys, shared,
                          _loss_scaler(optims, optim_files), model, engine)


def _read_stage0(path: Path, model: dict, engine: LoadingEngine | None) -> DeepSpeedState:
    """A stage-0 checkpoint: every state in rank 0's model states file, by position."""
    try:
        read = assemble_stage0(path, model, engine.param_order if engine else None)
    except CheckpointError:
        if engine is None or engine.optimizer_states:
            raise
        read = module_weights(model, engine.param_order)  # all this load reads
    module = dict(need(model, "module", path / "model_states"))
    shared = tied_keys(module)
    param_group = {name: gi for gi, group in enumerate(read.shapes) for name in group}
    module_tensors = {k: v for k, v in module.items() if k not in param_group and k not in shared}
    keys, shared = _without_excluded_ties(list(module), shared, param_group, module_tensors)
    return DeepSpeedState(path, 0, int(model.get("dp_world_size", 1)), read.params, param_group,
                          read.scalars, read.param_groups, module_tensors, keys, shared,
                          read.loss_scaler, model, engine)


def _without_excluded_ties(keys: list[str], shared: dict[str, str], *present: dict
                          ) -> tuple[list[str], dict[str, str]]:
    """(state dict keys, ties) less the ties of frozen parameters `save_checkpoint(...,
    exclude_frozen_parameters=True)` left out: DeepSpeed keeps a tied key (GPT-2's lm_head,
    frozen under LoRA with the embedding it shares) after dropping the parameter it names."""
    gone = {k for k, target in shared.items() if not any(target in p for p in present)}
    return [k for k in keys if k not in gone], {k: t for k, t in shared.items() if k not in gone}


def _loss_scaler(optims: list[dict], files: list[Path]) -> dict[str, Any]:
    """The attributes of the loss scaler every rank saved (the same on all; {} if none)."""
    scalers = [o.get("loss_scaler") for o in optims]
    for scaler, file in zip(scalers, files):
        if scaler is not None and not isinstance(scaler, LossScalerRecord):
            raise CheckpointError(f"{file}: 'loss_scaler' is a {type(scaler).__name__}, not "
                                  "DeepSpeed's LossScaler or DynamicLossScaler")
    states = [vars(s) if s is not None else {} for s in scalers]
    for state, file in zip(states[1:], files[1:]):
        if state != states[0]:
            raise CheckpointError(f"{file}: its loss scaler ({state}) differs from rank 0's "
                                  f"({states[0]}): the ranks' files are from different steps")
    return states[0]


def _optim_files(path: Path, world_size: int) -> list[Path]:
    """Rank r's optimizer states file, for each of the `world_size` ranks that saved."""
    pattern = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
    found = {int(m.group(2)): path / m.group(0)
             for m in (pattern.match(p.name) for p in path.iterdir()) if m}
    if not found:
        raise CheckpointError(f"{path} has DeepSpeed model states but no "
                              f"zero_pp_rank_*_mp_rank_00_optim_states.pt: not a ZeRO checkpoint "
                              f"(files: {sorted(p.name for p in path.iterdir())[:10]})")
    missing = [r for r in range(world_size) if r not in found]
    if missing:
        raise CheckpointError(f"{path} lacks the optimizer states of rank(s) {missing} of the "
                              f"{world_size} that saved it "
                              f"(zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt)")
    extra = sorted(r for r in found if r >= world_size)
    if extra:
        raise CheckpointError(f"{path} holds optimizer states of rank(s) {extra}, but its model "
                              f"states say {world_size} ranks saved it")
    return [found[r] for r in range(world_size)]


def _base_state(optim: dict, key: str, path: Path) -> tuple[list[dict], list[dict]]:
    """(per-group tensor states, per-group options) of the torch optimizer inside."""
    base = need(optim, key, path)
    if isinstance(base, list):  # elastic checkpoint: per-group states, padding removed
        return base, []
    state = need(base, "state", path)
    return [state[i] for i in sorted(state)], list(base.get("param_groups", []))


def _assemble_stage12(path: Path, optims: list[dict], shapes: list[dict],
                      files: list[Path]) -> tuple[dict, list, list]:
    bases = [_base_state(o, "base_optimizer_state", f) for o, f in zip(optims, files)]
    params: dict[str, dict[str, torch.Tensor]] = {}
    scalars = []
    for gi, group in enumerate(shapes):
        parts = [need(o, "single_partition_of_fp32_groups", f)[gi] for o, f in zip(optims, files)]
        flat = {"master": torch.cat([p.float() for p in parts])}
        states = [b[0][gi] for b in bases]
        for key in sorted(k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0):
            # each rank's states carry the padding its fp32 partition was saved without
            flat[key] = torch.cat([s[key].float().flatten()[:p.numel()]
                                   for s, p in zip(states, parts)])
        _split(path, group, flat, params)
        scalars.append(scalar_states(states[0]))
    return params, scalars, bases[0][1]


def _assemble_stage3(path: Path, optims: list[dict], shapes: list[dict],
                     world_size: int) -> tuple[dict, list, list]:
    per_rank = []
    # each sub-group's partition on a rank: its parameters, each padded to the world size
    numels = [sum(math.ceil(math.prod(shape) / world_size) for shape in group.values())
              for group in shapes]
    for rank, optim in enumerate(optims):
        file = path / f"rank {rank}"
        states, groups = _base_state(optim, "optimizer_state_dict", file)
        masters, states = swapped_in(path, rank, numels, need(optim, "fp32_flat_groups", file),
                                     states)
        flat = {"master": torch.cat([t.float().flatten() for t in masters])}
        for key in sorted(k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0):
            flat[key] = torch.cat([s[key].float().flatten() for s in states])
        per_rank.append(flat)
    keys = per_rank[0].keys()
    params: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            piece = math.ceil(numel / world_size)
            if offset + piece > per_rank[0]["master"].numel():
                raise CheckpointError(f"{path}: the fp32 partitions end before parameter "
                                      f"{name!r}: the model states do not match the optimizer "
                                      "states")
            params[name] = {k: torch.cat([r[k][offset:offset + piece] for r in per_rank])[:numel]
                            .view(shape).clone() for k in keys}
            offset += piece
    return (params, *_stage3_options(path, optims[0]))


def _stage3_options(path: Path, optim: dict) -> tuple[list, list]:
    """(scalar states, options) of each torch param group. Stage 3 splits each group into
    sub-groups (`sub_group_size`), each with its own flat tensor and optimizer state, which
    the group's `params` list; their steps are equal."""
    states, groups = _base_state(optim, "optimizer_state_dict", path)
    return [scalar_states(states[g["params"][0]]) if g.get("params") else {} for g in groups], groups


def _stage3_owners(path: Path, optim: dict, count: int) -> list[int]:
    """The torch param group of each of the `count` sub-groups, in `param_shapes` order."""
    _, groups = _base_state(optim, "optimizer_state_dict", path)
    owner = {index: gi for gi, group in enumerate(groups) for index in group.get("params", [])}
    if sorted(owner) != list(range(count)):
        raise CheckpointError(f"{path}: the optimizer's param groups hold the sub-groups "
                              f"{sorted(owner)}, but the model states list {count}: the files "
                              "are not of one checkpoint")
    return [owner[i] for i in range(count)]


def _assemble_universal(path: Path, optim: dict, shapes: list[dict],
                        stage: int) -> tuple[dict, list, list]:
    """Each parameter's states from its own files (`zero/<name>/<state>.pt`), whole already."""
    params = {name: _universal_states(path / "zero", name, shape)
              for group in shapes for name, shape in group.items()}
    kinds = {name: sorted(states) for name, states in params.items()}
    first, expected = next(iter(kinds.items()), ("", []))
    for name, found in kinds.items():
        if found != expected:
            raise CheckpointError(f"{path / 'zero' / name} holds the states {found}, but "
                                  f"{first}'s hold {expected}: the checkpoint is damaged")
    if stage == 3:  # no step files: the step is in rank 0's optimizer state, saved whole
        return (params, *_stage3_options(path, optim))
    scalars = [_universal_step(path / "zero" / next(iter(group)) / "step.pt") if group else {}
               for group in shapes]
    return params, scalars, list(need(optim, "param_groups", path / "zero" / "optimizer_state.pt"))


def _universal_states(zero: Path, name: str, shape) -> dict[str, torch.Tensor]:
    """{"master": fp32.pt's tensor, <state>: <state>.pt's tensor, ...} of parameter `name`."""
    folder = zero / name
    if name in ("", ".", "..") or "/" in name or "\\" in name or not folder.is_dir():
        raise CheckpointError(f"{zero} has no folder for parameter {name!r}, which the model "
                              "states list: the universal checkpoint is incomplete")
    files = {f.stem: f for f in folder.iterdir() if f.suffix == ".pt" and f.stem != "step"}
    if "fp32" not in files:
        raise CheckpointError(f"{folder} has no fp32.pt (the parameter's fp32 master): the "
                              "universal checkpoint is damaged")
    states = {}
    for kind, file in sorted(files.items()):
        saved = load_object(file)  # stage 3 writes the tensor bare, stages 1-2 in a dict
        tensor = need(saved, "param", file) if isinstance(saved, dict) else saved
        if not torch.is_tensor(tensor) or tensor.numel() != math.prod(shape):
            raise CheckpointError(f"{file} holds {_described(tensor)}, where the model states "
                                  f"give {name!r} the shape {list(shape)}")
        states["master" if kind == "fp32" else kind] = tensor.float().reshape(shape).clone()
    return states


def _universal_step(file: Path) -> dict[str, Any]:
    """A stage-1/2 parameter's optimizer step ({} where its optimizer keeps none)."""
    if not file.is_file():
        return {}
    step = load_object(file)
    if isinstance(step, bool) or not (isinstance(step, (int, float)) or
                                      torch.is_tensor(step) and step.dim() == 0):
        raise CheckpointError(f"{file} holds {_described(step)}, not an optimizer step")
    return scalar_states({"step": step})


def _described(value: object) -> str:
    return (f"a tensor of shape {list(value.shape)}" if torch.is_tensor(value)
            else f"a {type(value).__name__}")


def _split(path: Path, group: dict, flat: dict[str, torch.Tensor],
           params: dict[str, dict[str, torch.Tensor]]) -> None:
    """Cut one param group's flat tensors into its parameters, in `param_shapes` order."""
    at, total = 0, flat["master"].numel()
    for name, shape in group.items():
        numel = math.prod(shape)
        if at + numel > total:
            raise CheckpointError(f"{path}: the fp32 partitions hold {total} elements, fewer than "
                                  f"the parameters the model states list (at {name!r})")
        params[name] = {k: t[at:at + numel].view(shape).clone() for k, t in flat.items()}
        at += numel
    if at != total:
        raise CheckpointError(f"{path}: the fp32 partitions hold {total} elements but the "
                              f"parameters the model states list have {at}")


def _frozen_stage3(path: Path, model: dict, world_size: int) -> dict[str, torch.Tensor]:
    """Stage 3 saves each frozen parameter as per-rank partitions, one model file per rank."""
    shapes = dict(model.get("frozen_param_shapes") or {})
    if not shapes:
        return {}
    files = [path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)]
    fragments = [dict(need(load_pt(f, read=("frozen_param_fragments",)),
                            "frozen_param_fragments", f)) for f in files]
    return {name: torch.cat([f[name].flatten() for f in fragments])[:math.prod(shape)]
            .view(shape).clone() for name, shape in shapes.items()}


# ---------------------------------------------------------------- writing zeromem's format

def import_deepspeed(src: str | os.PathLike, dst: str | os.PathLike,
                     tag: str | None = None) -> str:
    """Convert the DeepSpeed ZeRO checkpoint at `src` into a zeromem checkpoint under `dst`.

    No process group needed. The result (`dst/<tag>`, `dst/latest`) loads with
    `engine.load_checkpoint(dst)` at any world size and stage. Returns its directory.
    The client state stays behind: `read_deepspeed(src).client_state()` reads it.
    """
    return write_imported(read_deepspeed(src, tag), dst)


def write_imported(ds: DeepSpeedState, dst: str | os.PathLike) -> str:
    """`ds` written as a one-rank zeromem checkpoint under `dst`; its directory."""
    out_tag, root = ds.path.name, Path(dst)
    specs = [TensorSpec.of(f"master/{name}", s["master"].flatten())
             for name, s in ds.params.items()]
    specs += [TensorSpec.of(f"optimizer/{key}/{name}", t.flatten())
              for name, s in ds.params.items() for key, t in s.items() if key != "master"]
    specs += [TensorSpec.of(f"module/{k}", t) for k, t in ds.module_tensors.items()]
    write_one_rank(root, out_tag, specs, _manifest(ds, out_tag))
    log.info("imported DeepSpeed stage-%d checkpoint %s (%d ranks) into %s", ds.stage, ds.path,
             ds.world_size, root / out_tag)
    return str(root / out_tag)


@contextmanager
def readable(ckpt_dir: str | os.PathLike, tag: str | None = None
             ) -> Iterator[tuple[str | os.PathLike, str | None]]:
    """(directory, tag) of a zeromem checkpoint holding what `ckpt_dir` holds: as given,
    or, for a DeepSpeed ZeRO checkpoint, imported into a temporary directory for the block."""
    where = deepspeed_location(ckpt_dir, tag)
    if where is None:
        yield ckpt_dir, tag
        return
    with tempfile.TemporaryDirectory(prefix="zeromem-deepspeed-") as tmp:
        import_deepspeed(where[0], tmp, where[1])
        yield tmp, where[1]


def _manifest(ds: DeepSpeedState, tag: str) -> dict:
    config = ds.model_states.get("ds_config") or {}
    engine = ds.engine
    optimizer, scheduler = optimizer_and_schedule(
        ds.path, ds.param_groups or [{}] * len(ds.scalars), ds.model_states,
        engine.optimizer_type if engine else None, engine.option_keys if engine else frozenset())
    gas = int(config.get("gradient_accumulation_steps", 1) or 1)
    global_steps = int(ds.model_states.get("global_steps", 0))
    samples = ds.model_states.get("global_samples")  # DeepSpeed's count, when it saved one
    state_keys = sorted({k for states in ds.params.values() for k in states if k != "master"})
    return {
        "format": FORMAT, "version": VERSION, "tag": tag, "world_size": 1,
        "zero_stage": ds.stage, "gradient_accumulation_steps": gas,
        "dtypes": {"compute": _compute_dtype(config), "master": "float32",
                   "optimizer": {k: "float32" for k in state_keys}},
        "counters": {"global_steps": global_steps, "micro_steps": global_steps * gas,
                     "skipped_steps": int(ds.model_states.get("skipped_steps", 0)),
                     "global_samples": samples if samples is None else int(samples)},
        "params": {name: {"shape": list(s["master"].shape), "param_group": ds.param_group[name],
                          "scalar_state": encode(ds.scalars[ds.param_group[name]],
                                                 "optimizer state")}
                   for name, s in ds.params.items()},
        "files": [],
        "state_dict_keys": ds.state_dict_keys,
        "aliases": {k: v for k, v in ds.aliases.items() if k in ds.state_dict_keys},
        "module_tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                           for k, t in ds.module_tensors.items()},
        # DeepSpeed records frozen_param_shapes (stages 2-3) unless exclude_frozen_parameters
        # left them out; stage 1 never records them, so its module may lack them either way
        "frozen_parameters_excluded": ds.model_states.get("frozen_param_shapes") is None,
        "frozen_parameters": _frozen_parameters(ds),
        "optimizer": {"type": optimizer[0], "tensor_states": state_keys,
                      "param_groups": optimizer[1]},
        "scaler": _scaler_state(ds, config),
        "lr_scheduler": scheduler,
        "client_state": None,
    }


def _frozen_parameters(ds: DeepSpeedState) -> list[str] | None:
    """The module tensors that are not buffers (DeepSpeed lists its buffers' names in every
    model states file); None where a file lacks the list."""
    names = ds.model_states.get("buffer_names")
    if not isinstance(names, (list, tuple)):
        return None
    buffers = set(names)
    return [k for k in ds.module_tensors if k not in buffers]


# zeromem's DynamicScaler state key -> DeepSpeed's DynamicLossScaler attribute (precision.py)
_DYNAMIC_SCALER = {"scale": "cur_scale", "hysteresis_left": "cur_hysteresis",
                   "iteration": "cur_iter", "last_overflow_iteration": "last_overflow_iter"}


def _scaler_state(ds: DeepSpeedState, config: dict) -> dict[str, Any]:
    """zeromem's loss scaler state from DeepSpeed's: the scale, hysteresis and clean-step
    count an fp16 run resumes with ({} without fp16: bf16 and fp32 do not scale)."""
    if not (config.get("fp16") or {}).get("enabled"):
        return {}
    saved, where = ds.loss_scaler, f"{ds.path}: the fp16 loss scaler"
    if not saved.get("dynamic", False):
        return {"scale": _number(saved, "cur_scale", where)}
    state = {ours: _number(saved, theirs, where) for ours, theirs in _DYNAMIC_SCALER.items()}
    return {k: float(v) if k == "scale" else int(v) for k, v in state.items()}


def _number(saved: dict, key: str, where: str) -> float:
    value = saved.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{where} has no number {key!r} (saved: {saved or 'nothing'}); "
                              "the checkpoint is damaged or from an unknown DeepSpeed version")
    return value


def _compute_dtype(config: dict) -> str:
    for block, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        if (config.get(block) or {}).get("enabled"):
            return dtype
    return "float32"
