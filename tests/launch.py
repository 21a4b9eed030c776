"""Run a test script under torchrun (2 gloo ranks on this machine), as users launch jobs."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

# torch's gloo now and then aborts a rank as its interpreter exits with a process group
# object still alive (pytorch#179291, abandoned). zeromem ends the groups it creates, so
# its runs exit 0; a plain DDP reference run is allowed this abort after writing its results.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def torchrun(script: Path, mode: str, out: Path, timeout_s: float = 240,
             reference_outputs: tuple[Path, ...] = ()) -> None:
    """`torchrun script mode out`, which must exit 0; `reference_outputs` marks a reference
    run, which may abort at exit as above once it has written all of them."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(script), mode, str(out)]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"torchrun {mode} ran past {timeout_s}s\n{str(error.stderr)[-3000:]}")
    if run.returncode and reference_outputs and GLOO_EXIT_ABORT in run.stderr \
            and all(path.exists() for path in reference_outputs):
        warnings.warn(f"the {mode} reference aborted at exit after writing its results")
        return
    assert run.returncode == 0, f"torchrun {mode} failed:\n{run.stderr[-6000:]}"
