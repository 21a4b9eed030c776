"""One rank of `zeromem launch`: what DeepSpeed's launcher gives each rank's script.

torchrun starts this module once per rank (`launcher.torchrun_arguments`). It sets up
what a script started by DeepSpeed's per-rank command line finds, then runs the script
as `python script args` would, in this process:
- `--local_rank=N` first among the script's arguments (unless `--no-local-rank`);
- DeepSpeed's extra variables beside torchrun's: CROSS_RANK (node index), CROSS_SIZE
  (nodes), LOCAL_SIZE (ranks on this node);
- zeromem registered as `deepspeed` (`install_as_deepspeed`) before the script imports
  anything, so `import deepspeed` and HF's DeepSpeed checks find zeromem;
- with `--bind-cores`, this rank's share of the cores and as many OpenMP threads;
- with `--rank-log PREFIX`, stdout and stderr in PREFIX<global rank>.log.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zeromem.deepspeed.launch_worker")
    p.add_argument("--no-local-rank", action="store_true")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no-python", action="store_true")
    p.add_argument("--bind-cores", default=None, help="'all' or a list such as 0,2-7")
    p.add_argument("--rank-log", default=None)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def command_line(script: str, script_args: Sequence[str], *, local_rank: bool = True,
                 module: bool = False, no_python: bool = False, bind_cores: str | None = None,
                 rank_log: str | None = None) -> list[str]:
    """This module's arguments (what `_parser` reads) for running `script` on each rank."""
    options = [flag for flag, on in (("--no-local-rank", not local_rank), ("--module", module),
                                     ("--no-python", no_python)) if on]
    if bind_cores is not None:
        options += ["--bind-cores", bind_cores]
    if rank_log is not None:
        options += ["--rank-log", rank_log]
    return [*options, "--", script, *script_args]


def parse_core_list(text: str) -> list[int]:
    """'1,3-5,7' -> [1, 3, 4, 5, 7] (DeepSpeed's --bind_core_list)."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        try:
            cores += range(int(first), int(last or first) + 1)
        except ValueError:
            raise ValueError(f"--bind_core_list {text!r}: expected numbers and ranges "
                             "such as 0,2-7") from None
    return cores


def cores_of_rank(cores: Sequence[int], local_rank: int, local_size: int) -> list[int]:
    """An equal, disjoint share of `cores` for each of the node's ranks, in rank order."""
    share = len(cores) // local_size
    if share == 0:
        raise ValueError(f"{len(cores)} cores cannot be shared among {local_size} ranks")
    return list(cores[local_rank * share:(local_rank + 1) * share])


def _bind(spec: str, local_rank: int, local_size: int) -> None:
    import torch

    available = sorted(os.sched_getaffinity(0)) if spec == "all" else parse_core_list(spec)
    mine = cores_of_rank(available, local_rank, local_size)
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    torch.set_num_threads(len(mine))


def _redirect(path: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) into `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: Sequence[str] | None = None) -> None:
    options = _parser().parse_args(argv)
    env = os.environ
    local_rank, local_size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    if options.rank_log is not None:
        _redirect(f"{options.rank_log}{env['RANK']}.log")
    env.update(CROSS_RANK=env["GROUP_RANK"], CROSS_SIZE=env["GROUP_WORLD_SIZE"],
               LOCAL_SIZE=str(local_size))
    if options.bind_cores is not None:
        _bind(options.bind_cores, local_rank, local_size)
    arguments = ([] if options.no_local_rank else [f"--local_rank={local_rank}"])
    arguments += options.script_args
    if options.no_python:
        os.execvp(options.script, [options.script, *arguments])
    from .install import install_as_deepspeed

    install_as_deepspeed()
    sys.argv = [options.script, *arguments]
    if options.module:  # as `python -m`: the working directory first on sys.path
        sys.path[0] = os.getcwd()
        runpy.run_module(options.script, run_name="__main__", alter_sys=True)
    else:  # as `python script`: the script's directory first on sys.path
        sys.path[0] = str(Path(options.script).resolve().parent)
        runpy.run_path(options.script, run_name="__main__")


if __name__ == "__main__":
    main()
