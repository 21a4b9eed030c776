"""Two torchrun agents on this machine as two "nodes" of 2 ranks form one 4-rank job.

One test runs the whole story, because each torchrun start costs seconds: the 2-node
stage-3 job (NVMe optimizer offload, a checkpoint written by both nodes), then a
standalone 1-node 4-rank job that trains the same steps from scratch and resumes
from that checkpoint. Checked: the 2-node losses equal the 1-node ones at every
step and rank; the resumed steps equal the uninterrupted ones; every rank's local
rank, node and device come from its node, and its swap directory from its global rank.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port

TORCHRUN = Path(sys.executable).parent / "torchrun"
SCRIPT = Path(__file__).with_name("multinode_script.py")
TIMEOUT_S = 240


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZEROMEM_RANKS_PER_NODE", None)  # the nodes come from torchrun here
    return env


def _finish(procs: list[subprocess.Popen], what: str) -> None:
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{what}: torchrun ran past {TIMEOUT_S}s")
        assert proc.returncode == 0, f"{what}: torchrun failed\n{err[-4000:]}"


def _two_nodes(out: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "multinode",
         str(SCRIPT), "job", str(out)], env=_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for node in range(2)]
    _finish(procs, "2 nodes x 2 ranks")


def _one_node(out: Path) -> None:
    procs = [subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "4",
                               str(SCRIPT), "resume", str(out)], env=_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)]
    _finish(procs, "1 node x 4 ranks")


def test_two_node_job_equals_one_node_and_its_checkpoint_loads_on_one(tmp_path):
    _two_nodes(tmp_path)
    _one_node(tmp_path)
    for rank in range(4):
        job = json.loads((tmp_path / f"job{rank}.json").read_text())
        fresh = json.loads((tmp_path / f"fresh{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resumed{rank}.json").read_text())
        assert job["losses"] == pytest.approx(fresh, abs=1e-6), rank
        assert resumed == pytest.approx(fresh[3:], abs=1e-6), rank
        # local and global rank differ on the second node; each is used where it belongs
        node = job["group_rank"]
        assert job["rank"] == 2 * node + job["local_rank"]
        assert (job["node"], job["layout_local_rank"]) == (node, job["local_rank"])
        assert job["device"] == "cpu"
        assert job["swap_dir"].startswith(f"zeromem-rank{rank}-"), job["swap_dir"]
    assert {json.loads((tmp_path / f"job{r}.json").read_text())["group_rank"]
            for r in range(4)} == {0, 1}
