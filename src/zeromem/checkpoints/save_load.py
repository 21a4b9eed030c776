"""Checkpoints that load under any world size, ZeRO stage or bucket size.

Every rank writes the part of the model state it owns: its slice of each flat
group's fp32 master and optimizer states, cut at parameter boundaries into
*pieces* named by parameter and element range. Nothing on disk refers to a flat
group, a bucket or a shard number, so a run with another world size, stage or
`reduce_bucket_size` assembles each of its shards from whichever files hold the
element ranges it needs, reading only those ranges (ZeRO paper, section 5: the
partition is an implementation detail of training, not of the model state).

On-disk layout:

    save_dir/
      latest                    text: the newest complete tag (written last, by os.replace)
      zero_to_fp32.py           scripts that run zeromem's converters, where DeepSpeed
      zero_to_torch.py          leaves its own (`python zero_to_fp32.py . OUTPUT_DIR`)
      <tag>/                    one complete checkpoint (default tag: global_step<N>)
        manifest.json           rank 0; describes everything below (see `_build_manifest`)
        rank00000.safetensors   rank r's pieces and RNG states, one file per rank
        rank00001.safetensors
        client_state.pt         rank 0, torch.save(client_state); absent when None. Loaded
                                with weights_only=True (dicts, lists, numbers, strings,
                                tensors) unless load_checkpoint(trust_client_state=True)
      .tmp-<tag>/               a save in progress; renamed to <tag> once complete
      .old-<tag>/               a tag being overwritten, alive between two renames

Tensors in rank r's safetensors file, all 1-D; a piece of parameter P holds
elements [offset, offset + numel) of P flattened:

    master/<P>                  fp32 master piece
    optimizer/<state>/<P>       optimizer state piece (exp_avg, ...), same range
    module/<key>                rank 0 only, whole, own dtype: buffers and frozen parameters
                                (`frozen_parameters`; out under exclude_frozen_parameters)
    rng/cpu, rng/cuda<i>, rng/numpy   this rank's generator states (Python's in metadata)

At stage 0 every rank holds the same whole state, so only rank 0 writes pieces.
Compute-dtype parameters are not stored: loading rebuilds them from the masters
(`TrainingState.refresh_params`). Scalar optimizer state (Adam's `step`) is stored per
parameter in the manifest. Tied weights, trained or frozen, are one tensor: stored once
under the first name; other state_dict keys naming it are listed in `aliases`.

Atomicity: ranks write into `.tmp-<tag>` and fsync; after every rank reported
success, rank 0 writes the manifest (with every file's sha256 and size), renames
the directory to `<tag>` and only then replaces `latest`. A crash at any moment
leaves the previous checkpoint and `latest` intact. Loading verifies every
file's checksum (each file by one rank, results shared) and reads all it needs
into host memory before it changes anything in the state.

Boundary: the functions here receive a `TrainingState` (training_state.py) that
the engine builds: module, flat groups, optimizer, comm, and the scaler, lr
scheduler, step counters and RNG as `Stateful` objects. They never see the
engine; after a load they ask the state to `refresh_params`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from zeromem.checkpoints.agreement import all_ranks_ok, attempt, check_same_tag, collective, share_rows
from zeromem.checkpoints.state import (check_states, continue_schedule, counters_state,
                                       param_groups_state, read_rng, restore_counters,
                                       restore_param_groups, restore_scaler, restore_scheduler,
                                       rng_to_file, saved_scalar_state, scalar_states,
                                       scaler_state, scheduler_state)
from zeromem.checkpoints.consolidate import (
    CLIENT_STATE, FORMAT, MANIFEST, VERSION, Piece, check_tag, checked_files, encode, file_digest,
    fsync_dir, overlaps, pieces_by_param, prepare_tmp, publish, raise_problems, rank_file_name,
    read_manifest, resolve_checkpoint, verify_file, write_latest, write_manifest,
    write_recovery_scripts)
from zeromem.checkpoints.formats import deepspeed_location
from zeromem.checkpoints.tensor_files import CheckpointError, SafetensorsReader, TensorSpec, write_safetensors
from zeromem.flat import FlatParamGroup
from zeromem.layout import ParamSlot
from zeromem.module_state import gathered_params
from zeromem.training_state import TrainingState

log = logging.getLogger("zeromem")

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint"]


# ---------------------------------------------------------------- layout of an engine's state

def group_pieces(group: FlatParamGroup, rank: int) -> list[tuple[ParamSlot, int, int, int]]:
    """(slot, start in the master shard, start in the parameter, length) that `rank` writes.

    Shards are [r * S, (r + 1) * S) of the flat buffer on every rank, so any rank
    can compute every rank's pieces. Unsharded groups are written by rank 0 only.
    """
    if group.shard_world == 1 and rank != 0:
        return []
    layout = group.layout.for_rank(rank if group.shard_world > 1 else 0)
    out = []
    for slot in group.slots:
        start, at, n = layout.owned_slice(slot.offset, slot.numel)
        if n:
            out.append((slot, start, at, n))
    return out


# ---------------------------------------------------------------- save (collectives: agreement.py)

def save_checkpoint(state: TrainingState, save_dir: str | os.PathLike, tag: str | None = None,
                    client_state: object = None, exclude_frozen_parameters: bool = False) -> str:
    """Write a checkpoint of the engine's `state` to `save_dir/<tag>` atomically; collective.

    Every rank writes its own pieces; rank 0 writes the manifest, publishes the
    directory and updates `latest`. `tag` defaults to `global_step<N>`; an
    existing tag is replaced. `client_state` (any picklable object) comes back
    from `load_checkpoint`. `exclude_frozen_parameters` leaves out the module's
    parameters that are not trained (requires_grad False); a load keeps the
    loading model's own values for them. Returns the checkpoint directory.
    """
    tag = check_tag(f"global_step{state.counters.global_steps}" if tag is None else str(tag))
    if state.counters.mid_accumulation():
        log.warning("saving in the middle of a gradient accumulation: gradients accumulated "
                    "so far are not part of the checkpoint")
    check_same_tag(state, tag)
    root, rank = Path(save_dir), state.comm.rank
    tmp = root / f".tmp-{tag}"
    collective(state, "preparing the checkpoint directory",
               lambda: prepare_tmp(root, tmp) if rank == 0 else None)
    try:
        with state.all_in_memory():  # masters and optimizer states in memory (offload/placement.py)
            manifest = collective(state, "describing the checkpoint",
                                  lambda: _build_manifest(state, tag, exclude_frozen_parameters)
                                  if rank == 0 else None)
            # stage 3's frozen parameters, whole on rank 0, which writes them with the buffers
            frozen = gathered_params(state.frozen_groups, state.comm, state.compute_dtype,
                                     keep=rank == 0)
            digest, error = attempt(lambda: _write_rank_file(state, tmp, rank,
                                                             exclude_frozen_parameters, frozen))
        rows = share_rows(state, _digest_row(digest, error))
        all_ranks_ok(state, error, "writing the checkpoint shards")
        client, error = attempt(lambda: _write_client_state(tmp, client_state)
                                if rank == 0 else None)
        all_ranks_ok(state, error, "writing client_state")
        collective(state, "publishing the checkpoint",
                   lambda: _finish(state, root, tmp, tag, manifest, rows, client)
                   if rank == 0 else None)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("checkpoint saved to %s", root / tag)
    return str(root / tag)


def _digest_row(digest: tuple[str, int] | None, error: BaseException | None) -> list[int]:
    if error is not None or digest is None:
        return [0] * 33
    return list(bytes.fromhex(digest[0])) + [digest[1]]


def _write_rank_file(state: TrainingState, tmp: Path, rank: int, exclude_frozen: bool,
                     frozen: dict[int, torch.Tensor]) -> tuple[str, int]:
    """This rank's safetensors file: its pieces, rank 0's module tensors, its RNG states."""
    specs: list[TensorSpec] = []
    for g in state.groups:
        states = _tensor_states(state.optimizer, g)
        for slot, s0, _, n in group_pieces(g, rank):
            # masters are saved fp32 (bf16 masters exactly): any run can load them
            specs.append(TensorSpec.of(f"master/{slot.name}", g.master.detach()[s0:s0 + n].float()))
            for key, t in states.items():
                specs.append(TensorSpec.of(f"optimizer/{key}/{slot.name}", t[s0:s0 + n]))
    if rank == 0:
        specs += [TensorSpec.of(f"module/{k}", t.detach())
                  for k, t in _module_tensors(state, exclude_frozen, frozen).items()]
    rng_specs, rng_meta = rng_to_file(state.stateful["rng"].state_dict())
    metadata = {"format": FORMAT, "rank": str(rank), **rng_meta}
    return write_safetensors(tmp / rank_file_name(rank), specs + rng_specs, metadata)


def _tensor_states(optimizer, group) -> dict[str, torch.Tensor]:
    """The group's optimizer states shaped like its master (sliced into pieces on disk)."""
    state = optimizer.state.get(group.master, {})
    out = {}
    for key, value in sorted(state.items()):
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape != group.master.shape:
                raise CheckpointError(f"optimizer state {key!r} has shape {tuple(value.shape)}, "
                                      f"not the master's {tuple(group.master.shape)}")
            out[key] = value.detach()
    return out


def _trained_ids(state: TrainingState) -> set[int]:
    return {id(p) for g in state.groups for p in g.params}


def _module_tensors(state: TrainingState, exclude_frozen: bool = False,
                    whole: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """state_dict entries that are not trained parameters: buffers and frozen parameters
    (without the frozen parameters when `exclude_frozen`). A frozen parameter sharded at
    stage 3 is its `whole` value, gathered (`gathered_params`); without it, a meta tensor
    of its shape and dtype."""
    trained, seen, out = _trained_ids(state), set(), {}
    frozen = frozen_keys(state) if exclude_frozen else set()
    sharded = {id(p): (s.shape, g.param_shard.dtype) for g in state.frozen_groups
               for p, s in zip(g.params, g.slots)}
    for key, value in state.module.state_dict(keep_vars=True).items():
        if not torch.is_tensor(value):
            log.warning("state_dict entry %s is not a tensor; it is not checkpointed", key)
        elif id(value) not in trained and id(value) not in seen and key not in frozen:
            seen.add(id(value))
            out[key] = value
            if id(value) in sharded:
                shape, dtype = sharded[id(value)]
                out[key] = whole[id(value)] if whole is not None else \
                    torch.empty(shape, dtype=dtype, device="meta")
    return out


def frozen_keys(state: TrainingState) -> set[str]:
    """state_dict keys of parameters nothing trains: requires_grad False, in no flat group."""
    trained = _trained_ids(state)
    return {key for key, value in state.module.state_dict(keep_vars=True).items()
            if isinstance(value, torch.nn.Parameter) and not value.requires_grad
            and id(value) not in trained}


def _aliases(state: TrainingState, exclude_frozen: bool = False
             ) -> tuple[list[str], dict[str, str]]:
    """All state_dict keys (less the frozen parameters when `exclude_frozen`), and
    {alias key: canonical key} for tensors reachable twice."""
    first: dict[int, str] = {id(p): n for g in state.groups for p, n in
                             zip(g.params, (s.name for s in g.slots))}
    frozen = frozen_keys(state) if exclude_frozen else set()
    keys, aliases = [], {}
    for key, value in state.module.state_dict(keep_vars=True).items():
        if not torch.is_tensor(value) or key in frozen:
            continue
        keys.append(key)
        canonical = first.setdefault(id(value), key)
        if canonical != key:
            aliases[key] = canonical
    return keys, aliases


def _write_client_state(tmp: Path, client_state: Any) -> dict | None:
    if client_state is None:
        return None
    path = tmp / CLIENT_STATE
    with open(path, "wb") as f:
        torch.save(client_state, f)
        f.flush()
        os.fsync(f.fileno())
    sha, size = file_digest(path)
    return {"name": CLIENT_STATE, "sha256": sha, "bytes": size}


def _build_manifest(state: TrainingState, tag: str, exclude_frozen: bool) -> dict:
    """Everything but the files' checksums (added in `_finish`); rank 0."""
    opt = state.optimizer
    params, tensor_states, kinds = {}, {}, {}
    for g in state.groups:
        states = _tensor_states(opt, g)
        tensor_states.update({k: str(v.dtype).removeprefix("torch.") for k, v in states.items()})
        scalars = encode(scalar_states(opt, g), "optimizer state")
        for slot in g.slots:
            params[slot.name] = {"shape": list(slot.shape), "param_group": g.param_group_index,
                                 "scalar_state": scalars}
            kinds[slot.name] = sorted(states)
    if len({tuple(k) for k in kinds.values()}) > 1:  # Muon's matrices keep momentum only
        for name, names in kinds.items():
            params[name]["tensor_states"] = names
    keys, aliases = _aliases(state, exclude_frozen)
    module_tensors, frozen = _module_tensors(state, exclude_frozen), frozen_keys(state)
    return {
        "format": FORMAT, "version": VERSION, "tag": tag,
        "world_size": state.comm.world_size, "zero_stage": state.zero_stage,
        "gradient_accumulation_steps": state.counters.gradient_accumulation_steps,
        "dtypes": {"compute": str(state.compute_dtype).removeprefix("torch."),
                   "master": "float32", "optimizer": tensor_states},
        "counters": counters_state(state.counters),
        "params": params,
        "files": [],
        "state_dict_keys": keys,
        "aliases": aliases,
        "module_tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                           for k, t in module_tensors.items()},
        "frozen_parameters_excluded": exclude_frozen,
        "frozen_parameters": [k for k in module_tensors if k in frozen],
        "optimizer": {"type": state.optimizer_type, "tensor_states": sorted(tensor_states),
                      "param_groups": param_groups_state(state.optimizer)},
        "scaler": scaler_state(state.stateful["scaler"]),
        "lr_scheduler": scheduler_state(state.lr_scheduler),
        "client_state": None,
    }


def _finish(state: TrainingState, root: Path, tmp: Path, tag: str, manifest: dict | None,
            rows: list[list[int]], client: dict | None) -> None:
    """Rank 0: complete the manifest, then publish the directory, then `latest`."""
    assert manifest is not None  # rank 0 built it
    for rank, row in enumerate(rows):
        pieces = [[slot.name, p0, n] for g in state.groups
                  for slot, _, p0, n in group_pieces(g, rank)]
        manifest["files"].append({"name": rank_file_name(rank), "rank": rank,
                                  "sha256": bytes(row[:32]).hex(), "bytes": row[32],
                                  "pieces": pieces})
    manifest["client_state"] = client
    write_manifest(tmp, manifest)
    fsync_dir(tmp)
    publish(root, tmp, tag)
    write_latest(root, tag)
    write_recovery_scripts(root)


# ---------------------------------------------------------------- load

@dataclass
class _Staged:
    """Everything a load puts into the state, read and checked before anything changes."""

    manifest: dict
    masters: list[torch.Tensor]  # per flat group: its new master shard, on the host
    states: list[dict[str, Any]] | None  # per flat group: optimizer state; None keeps the current
    module: dict[str, torch.Tensor] = field(default_factory=dict)  # buffers, frozen parameters
    rng: dict[str, Any] | None = None  # this rank's generators; None leaves them
    client_state: Any = None


def load_checkpoint(state: TrainingState, load_dir: str | os.PathLike, tag: str | None = None,
                    load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True,
                    trust_client_state: bool = False, universal: bool = False) -> tuple[str, Any]:
    """Load a checkpoint into the engine's `state`, under any world size, stage or bucket size;
    collective.

    `tag` defaults to the one `latest` names (`latest_universal` first if `universal`,
    DeepSpeed's `checkpoint.load_universal`). Every file is checked against its
    checksum and the manifest against the model, and everything is read into host
    memory, before anything changes: on any error (a `CheckpointError` naming the
    file or parameter, raised on every rank) the state is as it was. Returns
    (checkpoint directory, client_state).

    Only paths inside `load_dir` are followed. `client_state` is unpickled with
    `weights_only=True` (containers, numbers, strings, tensors): a checkpoint
    directory someone else can write cannot run code in this process. Pass
    `trust_client_state=True` for client state holding other objects, and only
    for checkpoints you wrote yourself.

    A DCP directory of an FSDP2 run (`load_dir`, or `tag` inside it), the folder
    Accelerate's `save_state` or the Hugging Face Trainer writes, or one torch file of a
    run's state dict (`dcp_to_torch_save`'s), is imported the same way
    (`checkpoints/torch_import.py`); it returns (that path, None).
    A DeepSpeed ZeRO checkpoint (stages 1-3, or its universal form;
    `checkpoints/deepspeed_import.py`) is imported first, by each rank into a private
    temporary directory, then loaded the same way; it returns DeepSpeed's tag directory and
    the client state DeepSpeed's `load_checkpoint` would (`DeepSpeedState.client_state`).
    """
    torch_state = _torch_state(Path(load_dir), tag)
    if torch_state is not None:
        return _load_torch_file(state, torch_state, load_optimizer_states,
                                load_lr_scheduler_states)
    where = deepspeed_location(load_dir, tag, universal)
    if where is not None:
        return _load_deepspeed(state, where, load_optimizer_states, load_lr_scheduler_states)
    return _load(state, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                 trust_client_state)


def _load_deepspeed(state: TrainingState, where: tuple[Path, str], load_optimizer_states: bool,
                    load_lr_scheduler_states: bool) -> tuple[str, Any]:
    from zeromem.checkpoints.deepspeed_import import (DeepSpeedState, LoadingEngine,
                                                      read_deepspeed, write_imported)

    root, tag = where
    with tempfile.TemporaryDirectory(prefix="zeromem-deepspeed-") as tmp:
        def imported() -> DeepSpeedState:
            ds = read_deepspeed(root, tag, engine=LoadingEngine.of(state, load_optimizer_states))
            write_imported(ds, tmp)
            return ds

        ds = collective(state, f"importing DeepSpeed checkpoint {root / tag}", imported)
        _load(state, tmp, tag, load_optimizer_states, load_lr_scheduler_states, False,
              shown=root)
    return str(root / tag), ds.client_state()


def _torch_state(load_dir: Path, tag: str | None) -> Path | None:
    """The torch file or DCP directory (itself, or `tag` inside it) to import; None if neither."""
    from zeromem.checkpoints.torch_import import is_torch_state

    where = load_dir / tag if tag is not None and not load_dir.is_file() else load_dir
    return where if is_torch_state(where) else None


def _load_torch_file(state: TrainingState, file: Path, load_optimizer_states: bool,
                     load_lr_scheduler_states: bool) -> tuple[str, Any]:
    from zeromem.checkpoints.torch_import import write_torch_state

    with state.all_in_memory():  # the manifest this engine would save: the import's template
        template = _build_manifest(state, "", exclude_frozen=False)
    with tempfile.TemporaryDirectory(prefix="zeromem-torch-") as tmp:
        tag = collective(state, f"importing {file}",
                         lambda: write_torch_state(file, Path(tmp), template, load_optimizer_states))
        _load(state, tmp, tag, load_optimizer_states, load_lr_scheduler_states, False,
              shown=file.parent)
    if load_lr_scheduler_states:  # the file keeps no schedule of the engine's: its step does
        continue_schedule(state.lr_scheduler, state.counters.global_steps)
    return str(file), None


def _load(state: TrainingState, load_dir, tag: str | None, load_optimizer_states: bool,
          load_lr_scheduler_states: bool, trust_client_state: bool,
          shown: str | os.PathLike | None = None) -> tuple[str, Any]:
    """`load_checkpoint` of a zeromem checkpoint; ranks compare `shown/<tag>` (default:
    `load_dir`), so that each may read its own copy of one checkpoint."""
    path, manifest = collective(
        state, "reading the checkpoint manifest",
        lambda: _open_checked(state, load_dir, tag, load_optimizer_states,
                              load_lr_scheduler_states))
    same = Path(load_dir if shown is None else shown) / path.name
    h = int.from_bytes(hashlib.sha256(str(same).encode()).digest()[:7], "little")
    if len({row[0] for row in share_rows(state, [h])}) > 1:
        raise CheckpointError(f"ranks resolved different checkpoints (this rank: {path}); "
                              "was `latest` replaced during the load?")
    _verify_files(state, path, manifest)
    staged = collective(state, "reading the checkpoint",
                        lambda: _stage(state, path, manifest, load_optimizer_states,
                                       trust_client_state))
    with state.all_in_memory():  # masters and optimizer states in memory (offload/placement.py)
        _apply(state, staged, load_lr_scheduler_states)
    # stage 3's sharded frozen parameters: each rank's part into its shard, wherever the
    # parameter placement keeps it, as any load into the module (module_state.py)
    frozen = _module_values(state, staged, sharded=True)
    if frozen:
        state.module.load_state_dict(frozen, strict=False)
    state.refresh_params()  # the compute-dtype parameters from the loaded masters
    log.info("loaded checkpoint %s (saved by %d ranks at stage %d)", path,
             manifest["world_size"], manifest["zero_stage"])
    return str(path), staged.client_state


def _open_checked(state: TrainingState, load_dir, tag, load_optimizer_states: bool,
                  load_lr_scheduler_states: bool) -> tuple[Path, dict]:
    path = resolve_checkpoint(load_dir, tag)
    manifest = read_manifest(path)  # the whole schema
    _check_model(state, manifest, path / MANIFEST, load_optimizer_states)
    check_states(state, manifest, load_optimizer_states, load_lr_scheduler_states)
    return path, manifest


def _check_model(state: TrainingState, manifest: dict, file: Path,
                 load_optimizer_states: bool) -> None:
    """The checkpoint must hold exactly this model's parameters and buffers, same shapes;
    frozen parameters it left out (exclude_frozen_parameters) keep this model's values."""
    trained = {s.name: list(s.shape) for g in state.groups for s in g.slots}
    unset = [n for n in trained if n not in manifest["params"]
             and n not in manifest["module_tensors"]]
    if unset and manifest.get("frozen_parameters_excluded"):
        raise CheckpointError(f"{file} was saved without frozen parameters and lacks "
                              f"{unset[:5]}, which this model trains: the load would leave "
                              "them unset. Freeze them as the saving run did, or load a "
                              "checkpoint that holds them")
    _compare("parameter", trained, {n: p["shape"] for n, p in manifest["params"].items()}, file)
    kept = _kept_frozen(state, manifest)
    _compare("buffer or frozen parameter",
             {k: list(t.shape) for k, t in _module_tensors(state).items() if k not in kept},
             {k: v["shape"] for k, v in manifest["module_tensors"].items()}, file)
    pieces_by_param(manifest)  # every parameter fully covered by pieces
    if not load_optimizer_states:
        return
    saved, here = manifest["optimizer"], state.optimizer
    if len(saved["param_groups"]) != len(here.param_groups):
        raise CheckpointError(f"{file}: {len(saved['param_groups'])} optimizer param groups, "
                              f"this engine has {len(here.param_groups)}")
    if saved["tensor_states"] and saved["type"] != state.optimizer_type:
        raise CheckpointError(f"{file} holds {saved['type']} states but this engine uses "
                              f"{state.optimizer_type}; pass load_optimizer_states=False")


def _kept_frozen(state: TrainingState, manifest: dict) -> set[str]:
    """This model's frozen parameters that the checkpoint left out on purpose."""
    if not manifest.get("frozen_parameters_excluded"):
        return set()
    saved = manifest["module_tensors"].keys() | manifest["params"].keys()
    kept = {k for k in frozen_keys(state) if k not in saved}
    if kept:
        log.info("the checkpoint was saved without frozen parameters; %s keep their values",
                 sorted(kept))
    return kept


def _compare(kind: str, here: dict[str, list[int]], saved: dict[str, list[int]],
             file: Path) -> None:
    missing = [n for n in here if n not in saved]
    extra = [n for n in saved if n not in here]
    if missing:
        raise CheckpointError(f"{file} is from another model: {kind} {missing[0]!r} is not in "
                              f"it ({len(missing)} missing: {missing[:5]})")
    if extra:
        raise CheckpointError(f"{file} is from another model: it has {kind} {extra[0]!r}, "
                              f"which this model lacks ({len(extra)} unknown: {extra[:5]})")
    for name, shape in here.items():
        if list(saved[name]) != shape:
            raise CheckpointError(f"{file} is from another model: {kind} {name!r} has shape "
                                  f"{list(saved[name])} there and {shape} here")


def _verify_files(state: TrainingState, path: Path, manifest: dict) -> None:
    """Each file is hashed by one rank (file i by rank i mod N); all ranks see all results."""
    comm, files = state.comm, checked_files(manifest)
    codes = [verify_file(path / f["name"], f["sha256"], f["bytes"])
             if i % comm.world_size == comm.rank else 0 for i, f in enumerate(files)]
    if files:
        codes = [sum(column) for column in zip(*share_rows(state, codes))]
    raise_problems(path, files, codes)


def _stage(state: TrainingState, path: Path, manifest: dict, load_optimizer_states: bool,
           trust_client_state: bool) -> _Staged:
    index = pieces_by_param(manifest)
    names = manifest["optimizer"]["tensor_states"] if load_optimizer_states else []
    dtypes = manifest["dtypes"]["optimizer"]
    readers: dict[str, SafetensorsReader] = {}

    def reader(name: str) -> SafetensorsReader:
        if name not in readers:
            readers[name] = SafetensorsReader(path / name)
        return readers[name]

    try:
        masters, states = [], []
        for g in state.groups:
            tensors = {"master": torch.zeros(g.shard_numel, dtype=torch.float32)}
            tensors.update({k: torch.zeros(g.shard_numel, dtype=getattr(torch, dtypes[k]))
                            for k in _states_of(g, manifest, names)})
            _read_shard(g, index, reader, tensors)
            masters.append(tensors.pop("master"))
            if load_optimizer_states:
                states.append({**tensors, **saved_scalar_state(state.device, g, manifest)})
        module = {k: reader(rank_file_name(0)).read(f"module/{k}").view(v["shape"])
                  for k, v in manifest["module_tensors"].items()}
        rng = read_rng(reader, manifest, state.comm.rank)
    finally:
        for r in readers.values():
            r.close()
    client = None
    if manifest.get("client_state"):
        client = _read_client_state(path / CLIENT_STATE, trust_client_state)
    return _Staged(manifest, masters, states if load_optimizer_states else None, module, rng,
                   client)


def _read_client_state(file: Path, trust: bool) -> Any:
    """The client state; arbitrary pickled objects only when the caller trusts the file.

    The checksum does not vouch for it: the manifest holding the checksum lives in
    the same directory, so whoever can write one can write both.
    """
    if trust:
        return torch.load(file, map_location="cpu", weights_only=False)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{file} holds objects other than containers, numbers, strings and tensors, which "
            "could run code when loaded; pass load_checkpoint(..., trust_client_state=True) "
            f"only if you trust who wrote this checkpoint ({str(error).splitlines()[0]})") from None


def _states_of(group, manifest: dict, names: list[str]) -> list[str]:
    """The optimizer states saved for the group's parameters (of `names`, the ones to load):
    the same for all of them, as in the engine that saved them (older manifests list one set
    for every parameter)."""
    kinds = {tuple(k for k in manifest["params"][s.name].get("tensor_states", names) if k in names)
             for s in group.slots}
    if len(kinds) > 1:
        raise CheckpointError(f"the checkpoint's optimizer states differ between parameters of "
                              f"one flat group here ({group.slots[0].name!r}...: "
                              f"{sorted(kinds)}); was it saved with other param groups?")
    return list(kinds.pop()) if kinds else []


def _read_shard(group, index: dict[str, list[Piece]], reader: Callable[[str], SafetensorsReader],
                tensors: dict[str, torch.Tensor]) -> None:
    """Fill this rank's shard of each tensor from whichever files hold the needed ranges."""
    for slot in group.slots:
        s0, p0, n = group.owned_slice(slot)
        for piece, src, dst, m in overlaps(index[slot.name], p0, n):
            file = reader(piece.file)
            at = s0 + dst
            for kind, shard in tensors.items():
                key = f"master/{slot.name}" if kind == "master" else f"optimizer/{kind}/{slot.name}"
                file.read(key, src, m, out=shard[at:at + m])


def _module_values(state: TrainingState, staged: _Staged, sharded: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's module tensors of stage 3's sharded frozen parameters (`sharded`),
    or the others (buffers, frozen parameters kept whole)."""
    state_dict = state.module.state_dict(keep_vars=True)
    ids = {id(p) for g in state.frozen_groups for p in g.params}
    return {k: v for k, v in staged.module.items() if (id(state_dict[k]) in ids) == sharded}


def _like_master(value: Any, master: torch.Tensor) -> Any:
    """A saved per-element state on the master's device, in its dtype when floating (bf16
    masters keep bf16 states; a bf16-master checkpoint loads into fp32 masters too)."""
    if not torch.is_tensor(value) or not value.dim():
        return value
    return value.to(master.device, master.dtype if value.is_floating_point() else value.dtype)


def _apply(state: TrainingState, staged: _Staged, load_lr_scheduler_states: bool) -> None:
    """Put a staged checkpoint into the training state; nothing here reads a file."""
    m = staged.manifest
    with torch.no_grad():
        for g, master in zip(state.groups, staged.masters):
            g.master.copy_(master.view_as(g.master))
        state_dict = state.module.state_dict(keep_vars=True)
        for key, value in _module_values(state, staged, sharded=False).items():
            state_dict[key].copy_(value)
    if staged.states is not None:
        for g, saved in zip(state.groups, staged.states):
            state.optimizer.state[g.master] = {k: _like_master(v, g.master) for k, v in saved.items()}
        restore_param_groups(state.optimizer, m)
        restore_scaler(state.stateful["scaler"], m)
    if load_lr_scheduler_states:
        restore_scheduler(state.lr_scheduler, state.optimizer, m)
    restore_counters(state.counters, m)
    if staged.rng is not None:
        state.stateful["rng"].load_state_dict(staged.rng)
