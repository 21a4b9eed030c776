"""`zeromem accelerate-launch`: `accelerate launch` with zeromem as its DeepSpeed.

TRL's and Accelerate's recipes start DeepSpeed jobs as

    accelerate launch --config_file deepspeed_zero3.yaml train.py ...

Accelerate then refuses to go on unless the launching process finds a `deepspeed`
package (and imports `deepspeed.launcher.runner`), and each rank's script finds it too.
This command runs Accelerate's own launcher, with its own arguments and config file,
in a process where zeromem is registered as `deepspeed` (`install_as_deepspeed`), and
has every rank start through `launch_worker`, which registers it there before the
script imports anything. So `accelerate launch` becomes `zeromem accelerate-launch`,
the script and its config unchanged.

Several machines with Accelerate's pdsh/MPI DeepSpeed launchers would start DeepSpeed's
`deepspeed` command over ssh: use `deepspeed_multinode_launcher: standard` (torchrun
on each machine) instead.
"""
from __future__ import annotations

from typing import Sequence


def run(argv: Sequence[str]) -> int:
    """Accelerate's `launch` command on `argv`, each rank's script run by `launch_worker`."""
    from .install import install_as_deepspeed
    from .launch_worker import command_line

    install_as_deepspeed()  # before accelerate is imported: it decides at import time
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch = launch_command_parser().parse_args(list(argv))
    # no --local_rank: Accelerate passes none
    launch.training_script_args = command_line(launch.training_script, launch.training_script_args,
                                               local_rank=False, module=launch.module)
    launch.training_script, launch.module = "zeromem.deepspeed.launch_worker", True
    launch_command(launch)
    return 0
