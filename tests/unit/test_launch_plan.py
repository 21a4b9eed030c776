"""`zeromem launch` decides the ranks DeepSpeed's launcher would (no process is started)."""
from __future__ import annotations

import argparse

import pytest

from zeromem.deepspeed.launch_worker import cores_of_rank, parse_core_list
from zeromem.deepspeed.launcher import (Launch, add_arguments, parse_hostfile, plan,
                                        torchrun_arguments, worker_arguments)

HOSTS = "# two nodes of four\nnode-a slots=4\nnode-b slots=4  # second\n"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*argv, "train.py", "--deepspeed", "--lr", "1"])


def _plan(*argv: str, env=None, gpus: int = 0, hostfile: str | None = None) -> Launch:
    return plan(_args(*argv), env or {}, gpus, hostfile)


def test_script_arguments_pass_through_untouched():
    args = _args("--num_gpus", "2")
    assert (args.user_script, args.user_args) == ("train.py", ["--deepspeed", "--lr", "1"])
    assert worker_arguments(args, None) == ["--", "train.py", "--deepspeed", "--lr", "1"]


def test_one_node_uses_every_gpu_unless_told():
    assert _plan(gpus=4).slots == (0, 1, 2, 3)
    assert _plan("--num_gpus", "2", gpus=4).slots == (0, 1)
    assert _plan("--include", "localhost:1,3", gpus=4).slots == (1, 3)
    assert _plan("--exclude", "localhost:0", gpus=4).slots == (1, 2, 3)
    launch = _plan(gpus=4)
    assert (launch.nnodes, launch.node_rank, launch.master_addr, launch.master_port,
            launch.on_gpus) == (1, 0, "127.0.0.1", 29500, True)


def test_visible_devices_are_the_slots_unless_a_flag_picks_them():
    env = {"CUDA_VISIBLE_DEVICES": "2,5"}
    assert _plan(env=env, gpus=2).slots == (2, 5)
    assert _plan("--num_gpus", "1", env=env, gpus=2).slots == (0,)


def test_cpu_runs_one_rank_unless_told():
    assert _plan().slots == (0,) and not _plan().on_gpus
    assert _plan("--num_gpus", "3").slots == (0, 1, 2)


def test_hostfile_with_no_ssh_starts_this_node_of_the_job():
    launch = _plan("--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1", hostfile=HOSTS)
    assert (launch.nnodes, launch.node_rank, launch.slots, launch.master_addr) == \
        (2, 1, (0, 1, 2, 3), "10.0.0.1")
    launch = _plan("--no_ssh", "--node_rank", "0", "--master_addr", "a", "--include",
                   "node-a:0,1@node-b:2,3", hostfile=HOSTS)
    assert (launch.nnodes, launch.slots) == (2, (0, 1))
    assert _plan("--no_ssh", "--node_rank", "0", "--num_nodes", "1", hostfile=HOSTS).nnodes == 1


def test_torchrun_command_starts_the_worker_on_this_nodes_ranks():
    launch = Launch(2, 1, (0, 1, 2), "10.0.0.1", 1234, True)
    args = _args("--module", "--no_local_rank", "--bind_cores_to_rank", "--bind_core_list", "0-5")
    command = torchrun_arguments(launch, worker_arguments(args, "logs/t_rank"))
    assert command == ["-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1",
                       "--nproc_per_node=3", "--master_addr=10.0.0.1", "--master_port=1234",
                       "-m", "zeromem.deepspeed.launch_worker", "--no-local-rank", "--module",
                       "--bind-cores", "0-5", "--rank-log", "logs/t_rank", "--",
                       "train.py", "--deepspeed", "--lr", "1"]


@pytest.mark.parametrize("argv, hostfile, message", [
    (("--autotuning", "tune"), None, "--autotuning"),
    (("--save_pid",), None, "--save_pid"),
    (("--num_gpus", "2", "--include", "localhost:0"), None, "--include"),
    (("--include", "localhost:0", "--exclude", "localhost:1"), None, "together"),
    (("--include", "worker-9:0",), None, "worker-9"),
    (("--include", "localhost:7",), None, "no slot [7]"),
    (("--module", "--no_python"), None, "--no_python"),
    ((), HOSTS, "ssh"),  # two hosts, started from here: DeepSpeed would pdsh
    (("--force_multi",), None, "ssh"),
    (("--no_ssh",), HOSTS, "--node_rank"),
    (("--no_ssh", "--node_rank", "0"), HOSTS, "--master_addr"),
    (("--num_nodes", "1"), HOSTS, "not this machine"),
])
def test_what_cannot_be_done_here_is_refused_by_name(argv, hostfile, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _plan(*argv, gpus=2, hostfile=hostfile)


def test_hostfile_errors_name_the_line():
    assert parse_hostfile(HOSTS, "h") == {"node-a": [0, 1, 2, 3], "node-b": [0, 1, 2, 3]}
    with pytest.raises(ValueError, match="h:2: expected 'host slots=N'"):
        parse_hostfile("a slots=1\nb slots\n", "h")
    with pytest.raises(ValueError, match="h:2: host 'a' is listed twice"):
        parse_hostfile("a slots=1\na slots=2\n", "h")


def test_cores_are_shared_disjointly_in_rank_order():
    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    cores = parse_core_list("0-7")
    shares = [cores_of_rank(cores, rank, 3) for rank in range(3)]
    assert shares == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="2 cores cannot be shared among 4 ranks"):
        cores_of_rank([0, 1], 0, 4)
    with pytest.raises(ValueError, match="0,x"):
        parse_core_list("0,x")
