"""Started by `zeromem launch` in test_deepspeed_launcher.py: writes what this rank was given.

Usage (as DeepSpeed's launcher runs a script): launcher_probe.py [--local_rank=N] OUT [fail]
"""
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import deepspeed  # answered by zeromem: nothing else named deepspeed is installed here

arguments = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]
out = Path(arguments[0])
rank = os.environ["RANK"]
print(f"probe rank {rank} started", flush=True)
written = out / f"rank{rank}.json.part"  # whole or absent: renamed once written
written.write_text(json.dumps({
    "argv": sys.argv[1:], "name": __name__, "path0": sys.path[0],
    "env": {k: os.environ.get(k) for k in ("LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK",
                                           "CROSS_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS")},
    "cores": sorted(os.sched_getaffinity(0)),
    "deepspeed": deepspeed.__name__,
    "hf_sees_deepspeed": [importlib.util.find_spec("deepspeed") is not None,
                          importlib.metadata.version("deepspeed")],
}))
written.replace(out / f"rank{rank}.json")
if arguments[1:] == ["fail"] and rank == "1":
    # rank 0 first writes what it saw: the launcher stops it when this rank fails, and on a
    # loaded machine rank 0 may still be importing then
    deadline = time.monotonic() + 60
    while not (out / "rank0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
