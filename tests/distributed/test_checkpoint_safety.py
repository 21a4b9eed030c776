"""Loading checkpoints someone else could write, and reclaiming what killed runs leave.

One rank, in this process: a checkpoint directory is hostile input (pickles that
run code, paths leading outside, damaged manifests) and every refused load must
leave the engine bit-identical. Leftovers are made by a real process killed with
SIGKILL.
"""
from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zeromem
from models import BufferedLM
from setups import checkpoint_config, train_global_batch
from zeromem.checkpoints.save_load import CheckpointError
from zeromem.checkpoints.consolidate import RECOVERY_SCRIPTS, file_digest


def engine_of(stage: int = 2, seed: int = 0, **extra):
    torch.manual_seed(seed)
    return zeromem.initialize(BufferedLM(), checkpoint_config(stage, 1, **extra))


def full_snapshot(engine) -> list:
    """Everything a load may change: masters, parameters and buffers, optimizer state and
    options, counters, scaler, scheduler and the generators."""
    state = [(k, v.clone() if torch.is_tensor(v) else v)
             for s in engine.optimizer.state.values() for k, v in sorted(s.items())]
    options = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    return ([g.master.clone() for g in engine.groups],
            [t.detach().clone() for t in engine.module.state_dict().values()], state, options,
            (engine.global_steps, engine.micro_steps, engine.skipped_steps),
            engine.scaler.state_dict(), engine.lr_scheduler.state_dict(),
            torch.get_rng_state(), random.getstate())


def assert_same(a, b) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def rewrite_manifest(tag_dir: Path, edit) -> None:
    path = tag_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


# ---------------------------------------------------------------- client state: no code from disk

class Planted:
    """Unpickling this creates `path`: what a hostile client_state.pt would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_client_state_objects_need_an_explicit_opt_in(tmp_path):
    engine = engine_of()
    train_global_batch(engine, 0, 1, range(1))
    ordinary = {"step": 3, "name": "run-a", "lrs": [1e-3, 2.5], "pair": (1, "x"),
                "t": torch.arange(4.0), "nested": {"none": None, "flag": True}}
    tag_dir = Path(engine.save_checkpoint(tmp_path, client_state=ordinary))
    fresh = engine_of(seed=1)
    _, client = fresh.load_checkpoint(tmp_path)  # ordinary state: loaded by default
    assert_same(client, ordinary)

    marker = tmp_path / "pwned"
    torch.save({"x": Planted(str(marker))}, tag_dir / "client_state.pt")
    sha, size = file_digest(tag_dir / "client_state.pt")
    rewrite_manifest(tag_dir, lambda m: m["client_state"].update(sha256=sha, bytes=size))
    victim = engine_of(seed=2)
    before = full_snapshot(victim)
    with pytest.raises(CheckpointError, match="trust_client_state=True"):
        victim.load_checkpoint(tmp_path)
    assert not marker.exists(), "unpickling ran code from the checkpoint directory"
    assert_same(before, full_snapshot(victim))
    _, client = victim.load_checkpoint(tmp_path, trust_client_state=True)  # the opt-in
    client["x"].close()
    assert marker.exists()


# ---------------------------------------------------------------- paths leading outside

def _hostile_cases(tmp: Path) -> dict:
    """name -> (edit of a copy of the good checkpoint `root`, tag to load)."""
    outside, evil = tmp / "outside.safetensors", tmp / "cases" / "evil"  # evil: beside each root
    good = lambda root: root / "good"  # noqa: E731

    def file_name(name):
        return lambda root: rewrite_manifest(good(root), lambda m: m["files"][0].update(name=name))

    def link(path, target):
        path.unlink()
        path.symlink_to(target)

    return {
        "tag ../evil": (None, "../evil"),
        "tag absolute": (None, str(evil)),
        "tag sub/../../evil": (None, "sub/../../evil"),
        "tag ..": (None, ".."),
        "tag .": (None, "."),
        "latest ../evil": (lambda root: (root / "latest").write_text("../evil"), None),
        "latest absolute": (lambda root: (root / "latest").write_text(str(evil)), None),
        "latest link outside": (lambda root: link(root / "latest", tmp / "evil-latest"), None),
        "tag dir link outside": (lambda root: (root / "link").symlink_to(evil), "link"),
        "file ../../outside": (file_name("../../outside.safetensors"), None),
        "file absolute": (file_name(str(outside)), None),
        "file in subdir": (file_name("sub/rank00000.safetensors"), None),
        "client_state ../": (lambda root: rewrite_manifest(good(root), lambda m: m[
            "client_state"].update(name="../../evil/client_state.pt")), None),
        "shard link outside": (lambda root: link(good(root) / "rank00000.safetensors", outside),
                               None),
        "manifest link outside": (lambda root: link(good(root) / "manifest.json",
                                                    evil / "manifest.json"), None),
    }


def test_load_refuses_paths_outside_the_checkpoint(tmp_path):
    engine = engine_of(stage=1)
    train_global_batch(engine, 0, 1, range(1))
    engine.save_checkpoint(tmp_path / "source", tag="good", client_state={"a": 1})
    engine.save_checkpoint(tmp_path / "cases", tag="evil", client_state={"a": 1})  # outside
    (tmp_path / "evil-latest").write_text("good")
    shutil.copy(tmp_path / "source" / "good" / "rank00000.safetensors",
                tmp_path / "outside.safetensors")
    victim = engine_of(stage=1, seed=3)
    before, refused, followed = full_snapshot(victim), [], []
    cases = _hostile_cases(tmp_path)
    for name, (edit, tag) in cases.items():
        root = tmp_path / "cases" / name.replace("/", "_").replace(" ", "_")
        shutil.copytree(tmp_path / "source", root, symlinks=True)
        if edit:
            edit(root)
        try:
            victim.load_checkpoint(root, tag=tag)
        except CheckpointError as error:
            if any(w in str(error) for w in ("outside", "refusing", "files[0]", "client_state")):
                refused.append(name)
            else:
                followed.append(f"{name}: unclear error {error}")
            assert_same(before, full_snapshot(victim))
        else:
            followed.append(f"{name}: loaded")
            victim = engine_of(stage=1, seed=3)  # a fresh victim for the next case
    print(f"hostile paths refused: {len(refused)} / {len(cases)}")
    assert not followed, followed


# ---------------------------------------------------------------- damaged manifests

def _walk(node, path=()):
    """(path, value) of every field and list element of a JSON tree."""
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else []
    for key, value in items:
        yield path + (key,), value
        yield from _walk(value, path + (key,))


def _wrong_type(value):
    if isinstance(value, str):
        return 7
    return ["big"] if value is None else "big"


# Fields a manifest may lack, so that manifests written before the field existed still load:
# frozen_parameters_excluded's default is the strict reading (False: every frozen parameter
# must be in the checkpoint), so removing it can only make a load refuse more; a missing
# counters.global_samples is DeepSpeed's estimate (global steps x the batch); without
# frozen_parameters a checkpoint loads and reads whole, and only zero_to_fp32's
# exclude_frozen_parameters is refused (test_frozen_tied.py).
OPTIONAL_FIELDS = {("frozen_parameters_excluded",), ("counters", "global_samples"),
                   ("frozen_parameters",)}


def _manifest_cases(manifest: dict) -> dict:
    """Each field removed, and each field or list element replaced by a wrong-typed value."""
    cases = {}
    for path, value in _walk(manifest):
        for kind in ("removed", "wrong type"):
            if kind == "removed" and (isinstance(path[-1], int) or path in OPTIONAL_FIELDS):
                continue  # list elements are not fields
            damaged = copy.deepcopy(manifest)
            parent = damaged
            for key in path[:-1]:
                parent = parent[key]
            if kind == "removed":
                del parent[path[-1]]
            else:
                parent[path[-1]] = _wrong_type(value)
            cases[(kind, path)] = damaged
    return cases


def test_damaged_manifest_is_refused_naming_the_field_and_changes_nothing(tmp_path):
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}  # a dynamic scaler's state too
    engine = engine_of(**fp16)
    train_global_batch(engine, 0, 1, range(2))
    tag_dir = Path(engine.save_checkpoint(tmp_path / "ckpt", client_state={"a": 1}))
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    victim = engine_of(seed=4, **fp16)
    train_global_batch(victim, 0, 1, range(1))
    before = full_snapshot(victim)
    cases, unclear = _manifest_cases(manifest), []
    for (kind, path), damaged in cases.items():
        (tag_dir / "manifest.json").write_text(json.dumps(damaged))
        field = next(k for k in reversed(path)  # encoding tags name no field
                     if isinstance(k, str) and not k.startswith("__"))
        try:
            victim.load_checkpoint(tmp_path / "ckpt")
        except CheckpointError as error:
            if field not in str(error):
                unclear.append(f"{kind} {path}: {error}")
        except Exception as error:  # noqa: BLE001 - anything else is the failure counted
            unclear.append(f"{kind} {path}: {type(error).__name__}: {error}")
        else:
            unclear.append(f"{kind} {path}: loaded")
        assert_same(before, full_snapshot(victim))
    print(f"damaged manifests refused with an error naming the field: "
          f"{len(cases) - len(unclear)} / {len(cases)}")
    assert not unclear, f"{len(unclear)} of {len(cases)}: " + "\n".join(unclear[:20])
    (tag_dir / "manifest.json").write_text(json.dumps(manifest))
    victim.load_checkpoint(tmp_path / "ckpt")  # the undamaged manifest still loads
    assert victim.scaler.state_dict() == engine.scaler.state_dict()


# ---------------------------------------------------------------- leftovers of killed runs

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from zeromem.offload.nvme import AsyncIO, SwapSpace
    from zeromem.checkpoints.consolidate import prepare_tmp
    root = Path(sys.argv[1])
    space = SwapSpace(root / "nvme", 0, AsyncIO(threads=1))
    space.file("states", 4096)
    prepare_tmp(root / "ckpt", root / "ckpt" / ".tmp-killed")
    print(space.dir, flush=True)
    time.sleep(600)
""")


def test_leftovers_of_a_killed_run_are_reclaimed_and_a_live_runs_kept(tmp_path):
    from zeromem.offload.nvme import AsyncIO, SwapSpace
    (tmp_path / "nvme").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        held = Path(holder.stdout.readline().strip())
        assert held.is_dir(), "the holder process did not start"
        engine = engine_of(stage=1)
        mine = SwapSpace(tmp_path / "nvme", 1, AsyncIO(threads=1))
        engine.save_checkpoint(tmp_path / "ckpt", tag="a")
        assert held.is_dir() and (tmp_path / "ckpt" / ".tmp-killed").is_dir()  # live: kept
        mine.close()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert held.is_dir() and (tmp_path / "ckpt" / ".tmp-killed").is_dir()  # SIGKILL: left
    again = SwapSpace(tmp_path / "nvme", 1, AsyncIO(threads=1))
    assert not held.exists(), "a dead process's swap directory was not reclaimed"
    again.close()
    engine.save_checkpoint(tmp_path / "ckpt", tag="b")
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(["a", "b", "latest", *RECOVERY_SCRIPTS])
    assert os.listdir(tmp_path / "nvme") == []


