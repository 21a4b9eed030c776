"""Mutation check: every known-bad edit in tests/mutants/*.json must make its tests fail.

Each JSON file is a list of mutants:

    {"name": "...", "why": "...", "file": "src/zeromem/engine.py",
     "old": "exact substring, present exactly once", "new": "the bad replacement",
     "tests": ["tests/test_x.py::test_name", ...]}

For each mutant, in sequence: copy src/ to a fresh temporary directory, apply the
edit there (the repository is never touched), and run its tests with `pytest -x -q`
and PYTHONPATH=<copy>/src:tests. PYTHONPATH comes before site-packages, and the
test harness's ranks (forked from a server pytest starts, or spawned) inherit both
the environment and sys.path, so the copy is imported even in ranks; the runner
checks that once, in a rank started by the harness, before any mutant runs. A
non-zero pytest exit means the mutant was caught.

    python tools/mutants.py [--only NAME ...] [--baseline] [FILE.json ...]

Prints a table (mutant, tests, result) and exits non-zero if any mutant survived
or did not apply.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900  # one mutant's tests; a hang the harness does not break counts as caught

# Run in a rank the test harness starts: where does zeromem come from?
PROBE = """
from harness import run_distributed

def where(rank, world_size):
    import zeromem
    return zeromem.__file__

if __name__ == "__main__":
    print(run_distributed(where, 1)[0])
"""


@dataclass
class Mutant:
    name: str
    why: str
    file: str
    old: str
    new: str
    tests: list[str]
    source: str  # the JSON file it came from


def load(paths: list[Path]) -> list[Mutant]:
    """Every mutant of the given JSON files, checked for the required keys."""
    mutants = []
    for path in paths:
        for i, entry in enumerate(json.loads(path.read_text())):
            missing = {"name", "why", "file", "old", "new", "tests"} - set(entry)
            if missing:
                raise SystemExit(f"{path}: mutant #{i} lacks {sorted(missing)}")
            mutants.append(Mutant(**{k: entry[k] for k in
                                     ("name", "why", "file", "old", "new", "tests")},
                                  source=path.name))
    return mutants


def environment(copy: Path) -> dict[str, str]:
    """The test environment with the copy's src first on the import path."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(copy / "src"), str(ROOT / "tests")])
    return env


def copy_src(into: Path) -> Path:
    """src/ copied under `into` (without caches and build metadata)."""
    shutil.copytree(ROOT / "src", into / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return into


def check_import_path() -> None:
    """Fail unless a harness rank imports zeromem from the copy, not the installed package."""
    with tempfile.TemporaryDirectory(prefix="mutant-probe-") as tmp:
        copy = copy_src(Path(tmp))
        probe = Path(tmp) / "probe.py"  # a file: a spawned rank re-imports the main module
        probe.write_text(PROBE)
        out = subprocess.run([sys.executable, str(probe)], env=environment(copy), cwd=tmp,
                             capture_output=True, text=True, timeout=120)
        where = out.stdout.strip()
        if not where.startswith(str(copy / "src")):
            raise SystemExit(f"a harness rank imports zeromem from {where or out.stderr!r}, "
                             f"not from the mutated copy under {copy}")


def apply(mutant: Mutant, copy: Path) -> str | None:
    """Edit the copy; an error message when the mutant does not apply."""
    if not mutant.file.startswith("src/"):
        return f"{mutant.file} is not under src/"
    target = copy / mutant.file
    if not target.is_file():
        return f"no file {mutant.file}"
    text = target.read_text()
    count = text.count(mutant.old)
    if count != 1:
        return f"'old' occurs {count} times in {mutant.file}"
    target.write_text(text.replace(mutant.old, mutant.new))
    return None


def run_tests(tests: list[str], copy: Path) -> tuple[int | None, str]:
    """(pytest exit code or None on timeout, output tail) for `tests` against the copy."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=environment(copy), capture_output=True,
                             text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TIMEOUT_S}s"
    return out.returncode, (out.stdout + out.stderr)[-2000:]


def run_one(mutant: Mutant, baseline: bool) -> tuple[str, float, str]:
    """(result, seconds, detail) of one mutant, each in its own fresh copy of src/."""
    start = time.monotonic()
    if baseline:
        with tempfile.TemporaryDirectory(prefix="mutant-base-") as tmp:
            code, tail = run_tests(mutant.tests, copy_src(Path(tmp)))
            if code != 0:
                return "tests-fail-unmutated", time.monotonic() - start, tail
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        copy = copy_src(Path(tmp))
        error = apply(mutant, copy)
        if error:
            return "does-not-apply", time.monotonic() - start, error
        code, tail = run_tests(mutant.tests, copy)
    seconds = time.monotonic() - start
    if code is None:
        return "caught (timeout)", seconds, tail
    if code == 5:  # pytest: no tests collected, so nothing could catch it
        return "SURVIVED (no tests ran)", seconds, tail
    return ("caught" if code != 0 else "SURVIVED"), seconds, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path,
                        help="mutant lists (default: tests/mutants/*.json)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these mutant names")
    parser.add_argument("--baseline", action="store_true",
                        help="first check each mutant's tests pass on the unmutated copy")
    args = parser.parse_args(argv)
    files = args.files or sorted((ROOT / "tests" / "mutants").glob("*.json"))
    mutants = [m for m in load(files) if args.only is None or m.name in args.only]
    if not mutants:
        print("no mutants found")
        return 1
    check_import_path()
    rows = []
    for m in mutants:
        result, seconds, detail = run_one(m, args.baseline)
        rows.append((m, result, seconds))
        print(f"[{len(rows)}/{len(mutants)}] {m.name}: {result} ({seconds:.0f}s)", flush=True)
        if not result.startswith("caught"):
            print("    " + detail.strip().replace("\n", "\n    "), flush=True)
    print(table(rows))
    bad = [m.name for m, result, _ in rows if not result.startswith("caught")]
    if bad:
        print(f"\n{len(bad)} of {len(rows)} mutants not caught: {', '.join(bad)}")
    return 1 if bad else 0


def table(rows: list[tuple[Mutant, str, float]]) -> str:
    """The results as a fixed-width table."""
    name_w = max(len("mutant"), *(len(m.name) for m, _, _ in rows))
    result_w = max(len("result"), *(len(r) for _, r, _ in rows))
    lines = [f"{'mutant':<{name_w}}  {'result':<{result_w}}  {'s':>5}  tests",
             "-" * (name_w + result_w + 30)]
    for m, result, seconds in rows:
        lines.append(f"{m.name:<{name_w}}  {result:<{result_w}}  {seconds:>5.0f}  "
                     + " ".join(t.split("/")[-1] for t in m.tests))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
