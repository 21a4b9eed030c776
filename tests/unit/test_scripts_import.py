"""Every benchmark and example still imports against the package.

The scripts reach into zeromem's modules (bench_offload times the NVMe optimizer's
own Adam kernel), and no test runs most of them: a name moved in the package broke
`benchmarks/bench_offload.py` silently once. One fresh interpreter imports them all
(their work is under `if __name__ == "__main__"`), with the package the tests use.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("benchmarks", "examples")

# zeromem first: the scripts put the repository's src at the front of sys.path, so a later
# first import would load it rather than the package under test (a mutated copy)
IMPORT_ALL = """
import importlib, sys, traceback
import zeromem
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
"""


def test_every_benchmark_and_example_imports():
    names = sorted(p.stem for folder in FOLDERS for p in (ROOT / folder).glob("*.py"))
    assert "bench_offload" in names and "train_nvme" in names
    # the mutation runner's PYTHONPATH (a mutated copy of src) comes first, as in spawned ranks
    path = os.pathsep.join([os.environ.get("PYTHONPATH", "")] + [str(ROOT / f) for f in FOLDERS]
                           + [str(ROOT / "src")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, *names], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"scripts that no longer import:\n{done.stdout}"
