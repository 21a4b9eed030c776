"""`zeromem launch` gives a script what DeepSpeed's `deepspeed` launcher gives it.

Each test starts real ranks through the console entry (`python -m zeromem.cli launch`,
then torchrun, then one `launch_worker` per rank) and reads what every rank saw.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import free_port

PROBE = Path(__file__).with_name("launcher_probe.py")
TESTS = Path(__file__).parents[1]


def _command(flags: list[str], script: list[str], port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "zeromem.cli", "launch", f"--master_port={port or free_port()}",
            *flags, *script]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def _launch(flags: list[str], script: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(_command(flags, script), cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=120)


def _seen(out: Path, ranks: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def test_each_rank_gets_its_local_rank_deepspeed_and_its_cores(tmp_path):
    """`deepspeed --num_gpus 2 --bind_cores_to_rank --enable_each_rank_log logs probe.py`."""
    done = _launch(["--num_gpus", "2", "--bind_cores_to_rank", "--enable_each_rank_log",
                    str(tmp_path / "logs")], [str(PROBE), str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = _seen(tmp_path, 2)
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // 2
    for rank, rank_saw in enumerate(seen):
        assert rank_saw["argv"] == [f"--local_rank={rank}", str(tmp_path)]
        assert rank_saw["env"] == {"LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "CROSS_RANK": "0",
                                   "CROSS_SIZE": "1", "LOCAL_SIZE": "2",
                                   "OMP_NUM_THREADS": str(share)}
        assert rank_saw["cores"] == cores[rank * share:(rank + 1) * share]
        assert (rank_saw["name"], rank_saw["path0"]) == ("__main__", str(PROBE.parent))
        assert rank_saw["deepspeed"] == "zeromem.deepspeed"
        assert rank_saw["hf_sees_deepspeed"][0] and "zeromem" in rank_saw["hf_sees_deepspeed"][1]
    logs = sorted((tmp_path / "logs").iterdir())
    assert [p.name.split("_", 1)[1] for p in logs] == ["rank0.log", "rank1.log"]
    for rank, log in enumerate(logs):
        assert f"probe rank {rank} started" in log.read_text()


def test_module_without_local_rank(tmp_path):
    """`deepspeed --module --no_local_rank distributed.launcher_probe OUT`: run as `python -m`."""
    done = _launch(["--num_gpus", "2", "--module", "--no_local_rank"],
                   ["distributed.launcher_probe", str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank_saw in _seen(tmp_path, 2):
        assert rank_saw["argv"] == [str(tmp_path)]
        assert (rank_saw["name"], rank_saw["path0"]) == ("__main__", str(tmp_path))


def test_a_failing_rank_fails_the_launch(tmp_path):
    done = _launch(["--num_gpus", "2"], [str(PROBE), str(tmp_path), "fail"], tmp_path)
    assert done.returncode != 0
    assert len(_seen(tmp_path, 2)) == 2  # both ran; rank 1 exited 3


def test_each_node_runs_its_own_launcher_without_ssh(tmp_path):
    """Two "nodes" of this machine from one hostfile, each `deepspeed --no_ssh --node_rank R`."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = free_port()
    nodes = [subprocess.Popen(
        _command(["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                  "--master_addr", "127.0.0.1"], [str(PROBE), str(tmp_path)], port),
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    for node in nodes:
        _, err = node.communicate(timeout=120)
        assert node.returncode == 0, err[-4000:]
    for rank, rank_saw in enumerate(_seen(tmp_path, 2)):
        assert rank_saw["argv"] == ["--local_rank=0", str(tmp_path)]
        assert {k: rank_saw["env"][k] for k in ("LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK",
                                                 "CROSS_SIZE", "LOCAL_SIZE")} == {
            "LOCAL_RANK": "0", "WORLD_SIZE": "2", "CROSS_RANK": str(rank), "CROSS_SIZE": "2",
            "LOCAL_SIZE": "1"}
