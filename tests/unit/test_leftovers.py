"""Leftover directories of killed runs (leftovers.py): which are reclaimed. No process group."""
from __future__ import annotations

import json
import os
import time


def test_owner_liveness_rules(tmp_path):
    from zeromem.leftovers import OWNER, UNOWNED_GRACE_S, owner_record, reclaim_stale
    dirs = {name: tmp_path / f"x-{name}" for name in
            ("alive", "recycled pid", "other host", "unowned new", "unowned old", "garbage")}
    for d in dirs.values():
        d.mkdir()
    me = owner_record()
    (dirs["alive"] / OWNER).write_text(json.dumps(me))
    (dirs["recycled pid"] / OWNER).write_text(json.dumps({**me, "start": me["start"] - 1}))
    (dirs["other host"] / OWNER).write_text(json.dumps({**me, "host": "elsewhere", "pid": 1}))
    (dirs["garbage"] / OWNER).write_text(json.dumps({"pid": "x"}))
    old = time.time() - UNOWNED_GRACE_S - 10
    os.utime(dirs["unowned old"], (old, old))
    removed = {p.name for p in reclaim_stale(tmp_path, "x-")}
    assert removed == {"x-recycled pid", "x-unowned old"}  # an unreadable owner: kept
