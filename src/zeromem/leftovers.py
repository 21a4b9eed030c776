"""Directories a process owns only while it lives: NVMe swap spaces and `.tmp-<tag>` saves.

A process killed by SIGKILL (or a SIGTERM nobody handled) runs no cleanup, so its
swap directory or half-written checkpoint stays on disk, as large as what it
held. Each such directory records its owner in `OWNER` (host, pid, and the pid's
start time, so a recycled pid is not mistaken for the owner); the next process
that creates one beside it (`reclaim_stale`) removes those whose owner is gone.
A directory owned by another host is never removed: liveness cannot be checked
from here. One without an owner file (the moment between mkdir and the write, or
written by an older zeromem) is removed only once older than `UNOWNED_GRACE_S`.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

log = logging.getLogger("zeromem")

OWNER = ".zeromem-owner.json"
UNOWNED_GRACE_S = 600.0  # an owner-less directory this old is a leftover, not a save starting


def process_start(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (/proc), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22; the name may hold spaces


def owner_record(pid: int | None = None) -> dict:
    """Who owns a directory: this process unless `pid` is given."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start": process_start(pid)}


def write_owner(directory: Path) -> None:
    """Mark `directory` as owned by this process (call right after creating it)."""
    (Path(directory) / OWNER).write_text(json.dumps(owner_record()))


def owner_alive(record: dict) -> bool:
    """Whether the owner may still run: another host's always may; here, same pid and start."""
    if record.get("host") != socket.gethostname():
        return True
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    return process_start(pid) is not None and process_start(pid) == record.get("start")


def is_stale(directory: Path) -> bool:
    """True when `directory`'s owner is gone (or it has none and is old enough)."""
    try:
        record = json.loads((directory / OWNER).read_text())
    except FileNotFoundError:
        try:
            return time.time() - directory.stat().st_mtime > UNOWNED_GRACE_S
        except OSError:
            return False
    except (OSError, ValueError):
        return False  # unreadable: not ours to judge
    return not isinstance(record, dict) or not owner_alive(record)


def reclaim_stale(root: Path, prefix: str, keep: Path | None = None) -> list[Path]:
    """Remove the directories `root/<prefix>*` whose owners are gone; returns those removed."""
    removed: list[Path] = []
    try:
        candidates = [p for p in Path(root).iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    for path in candidates:
        if path == keep or path.is_symlink() or not path.is_dir() or not is_stale(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            log.info("removed %s, left by a process that is gone", path)
            removed.append(path)
    return removed
