"""`zeromem launch`: DeepSpeed's `deepspeed` launcher, started on torchrun.

Scripts written for DeepSpeed are run as `deepspeed [flags] train.py args`: each rank
finds `--local_rank=N` on its command line (DeepSpeedExamples and DeepSpeed-Chat pick
their device from it) and `import deepspeed` at the top. `zeromem launch` reads the
same flags, decides the same ranks, and replaces itself with torchrun's agent; every
rank runs `launch_worker`, which gives the script what DeepSpeed's launcher gives it,
with zeromem answering `import deepspeed`. So

    deepspeed --num_gpus 8 train.py --deepspeed ds_config.json

becomes `zeromem launch --num_gpus 8 train.py --deepspeed ds_config.json`, the script
unchanged.

Ranks start on this machine only. DeepSpeed reaches the other nodes of a hostfile over
ssh (pdsh, MPI, slurm runners); here each node runs its own launcher with DeepSpeed's
flags for that (`--no_ssh --node_rank R --master_addr A`, the hostfile shared) or
torchrun under srun (README, Multi-node). What needs ssh is refused by name.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .launch_worker import command_line

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's: read when it exists and -H is not given
DEFAULT_PORT = 29500
_LOCAL_NAMES = {"localhost", "127.0.0.1"}
_REFUSED = {  # DeepSpeed's flags zeromem launch does not carry out, and why
    "autotuning": "DeepSpeed's autotuner is not part of zeromem (zeromem plan recommends a config)",
    "save_pid": "no pid file is written: torchrun's agent is the launcher's own process",
    "launcher_args": "it goes to an ssh/MPI launcher, and ranks start on this machine only",
    "ssh_port": "ranks start on this machine only; nothing is reached over ssh",
    "venv_script": "ranks start on this machine only, in this environment",
}


@dataclass(frozen=True)
class Launch:
    """What torchrun starts on this node: one agent's share of the job."""

    nnodes: int
    node_rank: int
    slots: tuple[int, ...]  # accelerator ids (CPU: rank slots) of this node's ranks
    master_addr: str
    master_port: int
    on_gpus: bool

    @property
    def nproc(self) -> int:
        return len(self.slots)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """DeepSpeed's launcher flags (`deepspeed --help`), then the script and its arguments."""
    p.add_argument("-H", "--hostfile", default=None,
                   help=f"lines 'host slots=N' (default {DEFAULT_HOSTFILE} when it exists)")
    p.add_argument("-i", "--include", default="", help="host[:slot,...][@host...] to use")
    p.add_argument("-e", "--exclude", default="", help="host[:slot,...][@host...] to leave out")
    p.add_argument("--num_nodes", type=int, default=-1, help="the first N hosts of the hostfile")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                   help="ranks per node, on accelerators 0..N-1 (CPU: N ranks; default 1)")
    p.add_argument("--master_port", type=int, default=DEFAULT_PORT)
    p.add_argument("--master_addr", default="")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index (with --no_ssh)")
    p.add_argument("--no_ssh", action="store_true", help="each node runs its own launcher")
    p.add_argument("--launcher", default="pdsh", help="accepted; only this node is started")
    p.add_argument("--no_ssh_check", action="store_true", help="accepted; nothing is ssh-checked")
    p.add_argument("--force_multi", action="store_true", help="refused: it needs ssh")
    p.add_argument("--module", action="store_true", help="run the script as 'python -m' would")
    p.add_argument("--no_python", action="store_true", help="execute the script directly")
    p.add_argument("--no_local_rank", action="store_true", help="pass no --local_rank=N")
    p.add_argument("--bind_cores_to_rank", action="store_true",
                   help="give each rank its own share of the cores (and OMP_NUM_THREADS)")
    p.add_argument("--bind_core_list", default=None, help="the cores to share, e.g. 0,2-7")
    p.add_argument("--enable_each_rank_log", default="None",
                   help="a directory: each rank's stdout and stderr in its own file")
    p.add_argument("--log_level", default="info", help="accepted")
    p.add_argument("-q", "--quiet", action="store_true", help="accepted")
    for flag in _REFUSED:  # --save_pid is a switch, the others take a value
        p.add_argument(f"--{flag}", help=argparse.SUPPRESS,
                       **({"action": "store_true"} if flag == "save_pid" else {"default": None}))
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)


def parse_hostfile(text: str, path: str) -> dict[str, list[int]]:
    """DeepSpeed's hostfile: 'host slots=N' per line, '#' comments, each host once."""
    hosts: dict[str, list[int]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if not match:
            raise ValueError(f"{path}:{number}: expected 'host slots=N', got {line!r}")
        if match[1] in hosts:
            raise ValueError(f"{path}:{number}: host {match[1]!r} is listed twice")
        hosts[match[1]] = list(range(int(match[2])))
    if not hosts:
        raise ValueError(f"{path}: no host in it")
    return hosts


def _node_specs(spec: str, flag: str) -> dict[str, list[int]]:
    """'worker-0@worker-1:0,2' -> {'worker-0': [], 'worker-1': [0, 2]} ([] = every slot)."""
    nodes: dict[str, list[int]] = {}
    for part in spec.split("@"):
        name, _, slots = part.partition(":")
        try:
            nodes[name] = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise ValueError(f"--{flag} {spec!r}: slots are integers, as in host:0,2") from None
    return nodes


def filter_resources(pool: dict[str, list[int]], include: str, exclude: str
                     ) -> dict[str, list[int]]:
    """DeepSpeed's --include / --exclude over a {host: slots} pool."""
    if include and exclude:
        raise ValueError("--include and --exclude cannot be used together")
    flag, spec = ("include", include) if include else ("exclude", exclude)
    if not spec:
        return pool
    chosen = {} if include else {h: list(s) for h, s in pool.items()}
    for host, slots in _node_specs(spec, flag).items():
        if host not in pool:
            raise ValueError(f"--{flag}: host {host!r} is not among {sorted(pool)}")
        missing = [s for s in slots if s not in pool[host]]
        if missing:
            raise ValueError(f"--{flag}: {host} has no slot {missing} (it has {pool[host]})")
        kept = slots or pool[host]
        chosen[host] = kept if include else [s for s in chosen[host] if s not in kept]
    return {h: s for h, s in chosen.items() if s}


def _local_pool(env: Mapping[str, str], device_count: int, filtered: bool) -> dict[str, list[int]]:
    """This machine's slots: its GPUs (those CUDA_VISIBLE_DEVICES lists when no flag picks
    them, as DeepSpeed), else one CPU rank."""
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if device_count and visible and not filtered:
        return {"localhost": [int(d) for d in visible.split(",") if d.strip()]}
    return {"localhost": list(range(device_count or 1))}


def plan(args: argparse.Namespace, env: Mapping[str, str], device_count: int,
         hostfile_text: str | None) -> Launch:
    """The ranks DeepSpeed's launcher would start on this node, or a ValueError naming why
    it cannot be done here."""
    for flag, why in _REFUSED.items():
        if getattr(args, flag) not in (None, False):
            raise ValueError(f"--{flag} is not supported: {why}")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise ValueError("--num_nodes/--num_gpus cannot be used with --include/--exclude")
    if args.module and args.no_python:
        raise ValueError("--module and --no_python cannot be used together")
    filtered = bool(args.include or args.exclude or args.num_gpus >= 0)
    pool = (parse_hostfile(hostfile_text, args.hostfile or DEFAULT_HOSTFILE)
            if hostfile_text is not None else _local_pool(env, device_count, filtered))
    active = filter_resources(pool, args.include, args.exclude)
    if args.num_nodes > 0:
        active = dict(list(active.items())[:args.num_nodes])
    if args.num_gpus > 0:
        active = {host: list(range(args.num_gpus)) for host in active}
    if not active:
        raise ValueError("no slot is left to run on")
    if args.no_ssh:
        return _this_node(args, active, device_count)
    if len(active) > 1 or args.force_multi:
        raise ValueError(
            f"{len(active)} hosts ({', '.join(active)}) need ranks started over ssh, which "
            "zeromem launch does not do: run it on each node with --no_ssh --node_rank R "
            "--master_addr A, or torchrun on each node (README, Multi-node)")
    (host, slots), = active.items()
    if hostfile_text is not None and host not in _LOCAL_NAMES | {socket.gethostname()}:
        raise ValueError(f"the hostfile's only host is {host!r}, not this machine: starting "
                         "it needs ssh; run zeromem launch there")
    return Launch(1, 0, tuple(slots), args.master_addr or "127.0.0.1", args.master_port,
                  device_count > 0)


def _this_node(args: argparse.Namespace, active: dict[str, list[int]], device_count: int
               ) -> Launch:
    if not 0 <= args.node_rank < len(active):
        raise ValueError(f"--no_ssh needs --node_rank in [0, {len(active)}), this node's "
                         f"index among {list(active)}; got {args.node_rank}")
    if len(active) > 1 and not args.master_addr:
        raise ValueError("--no_ssh over several nodes needs --master_addr (node 0's address)")
    slots = list(active.values())[args.node_rank]
    return Launch(len(active), args.node_rank, tuple(slots), args.master_addr or "127.0.0.1",
                  args.master_port, device_count > 0)


def worker_arguments(args: argparse.Namespace, log_prefix: str | None) -> list[str]:
    """`launch_worker`'s command line for DeepSpeed's per-rank flags."""
    return command_line(args.user_script, args.user_args, local_rank=not args.no_local_rank,
                        module=args.module, no_python=args.no_python,
                        bind_cores=(args.bind_core_list or "all") if args.bind_cores_to_rank
                        else None, rank_log=log_prefix)


def torchrun_arguments(launch: Launch, worker: Sequence[str]) -> list[str]:
    """torchrun's command line starting this node's ranks, each running `launch_worker`."""
    return ["-m", "torch.distributed.run", f"--nnodes={launch.nnodes}",
            f"--node_rank={launch.node_rank}", f"--nproc_per_node={launch.nproc}",
            f"--master_addr={launch.master_addr}", f"--master_port={launch.master_port}",
            "-m", "zeromem.deepspeed.launch_worker", *worker]


def _log_prefix(directory: str) -> str | None:
    """DeepSpeed's per-rank log names: <dir>/<launch time>_rank<R>.log."""
    if directory == "None":
        return None
    path = Path(directory)
    if path.is_file():
        raise ValueError(f"--enable_each_rank_log {directory}: a file, not a directory")
    path.mkdir(parents=True, exist_ok=True)
    return str(path / f"{time.strftime('%Y%m%d%H%M%S')}_rank")


def run(args: argparse.Namespace) -> int:
    """Become torchrun starting this node's ranks (its exit status is the job's)."""
    import torch

    hostfile = args.hostfile or (DEFAULT_HOSTFILE if Path(DEFAULT_HOSTFILE).is_file() else None)
    text = Path(hostfile).read_text() if hostfile else None
    launch = plan(args, os.environ, torch.cuda.device_count(), text)
    env = dict(os.environ)
    if launch.on_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, launch.slots))
    command = [sys.executable, *torchrun_arguments(
        launch, worker_arguments(args, _log_prefix(args.enable_each_rank_log)))]
    sys.stdout.flush()
    os.execve(sys.executable, command, env)
    return 0  # not reached: execve replaced this process
