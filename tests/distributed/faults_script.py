"""A tiny training job for the launch-path tests of test_faults.py (run under torchrun).

    faults_script.py MODE OUT_DIR

MODE: `train` (first, on the first attempt only, 6 uninterrupted steps into
`reference.json`; then 6 steps with a checkpoint every step, resumed from `latest`;
with KILL_AT_STEP set, rank 1 kills itself there on the first attempt), `exit`
(train, call `zeromem.shutdown()`, then leave: each rank writes `exit<rank>.txt`),
`own_group` (the script creates the group, trains, returns; `exit<rank>.txt` at exit),
`sigterm` (NVMe offload; print the swap directory, then wait to be stopped),
`frozen` (rank 1 stops answering; the others must fail within the config timeout).
Rank 0 writes `losses.json` (step -> loss) into OUT_DIR. Collectives time out
after TIMEOUT_S (a hang fails in seconds, with a message) unless a mode sets its own.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import zeromem

STEPS = 6
RESTART_DELAY_S = 3  # on restart rank 0 comes back late: its peer must wait for it
TIMEOUT_S = 30  # bounds the group's forming and every collective: a hang is an error


def build(config_extra: dict) -> zeromem.Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2, "overlap_comm": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zeromem": {"timeout_s": TIMEOUT_S}, **config_extra}
    return zeromem.initialize(model, config)


def step(engine: zeromem.Engine, index: int) -> float:
    """One optimizer step on data drawn from (rank, step): the same after a resume."""
    g = torch.Generator().manual_seed(1000 * engine.comm.rank + index)
    x = torch.randn(2, 8, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def reference(out: Path) -> None:
    """The uninterrupted run, in the same launch (one torchrun start fewer)."""
    engine = build({})
    losses = {str(i): step(engine, i) for i in range(STEPS)}
    engine.close()
    if engine.comm.rank == 0:
        (out / "reference.json").write_text(json.dumps(losses))


def train(out: Path) -> None:
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt:
        reference(out)
    elif os.environ["RANK"] == "0":
        time.sleep(RESTART_DELAY_S)  # rank 0 slow to come back: rank 1 must wait, not fail
    engine = build({})
    ckpt = out / "ckpt"
    start = 0
    if (ckpt / "latest").exists():
        _, client = engine.load_checkpoint(ckpt)
        start = client["next_step"]
    losses_file = out / "losses.json"
    losses = json.loads(losses_file.read_text()) if losses_file.exists() else {}
    kill_at = int(os.environ.get("KILL_AT_STEP", -1))
    for i in range(start, STEPS):
        if i == kill_at and first_attempt and engine.comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        losses[str(i)] = step(engine, i)
        engine.save_checkpoint(ckpt, client_state={"next_step": i + 1})
        if engine.comm.rank == 0:
            losses_file.write_text(json.dumps(losses))
    zeromem.shutdown()


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "train":
        train(out)
    elif mode == "exit":
        engine = build({})
        for i in range(3):
            step(engine, i)
        rank = engine.comm.rank
        zeromem.shutdown()
        import torch.distributed as dist
        # a file, not stdout: the check must not depend on how torchrun forwards output
        (out / f"exit{rank}.txt").write_text(f"group after shutdown: {dist.is_initialized()}")
    elif mode == "own_group":
        import atexit
        import torch.distributed as dist
        dist.init_process_group("gloo")  # the script's own group, as HF scripts create it
        rank = dist.get_rank()
        # registered before zeromem's exit handler, so it runs after it
        atexit.register(lambda: (out / f"exit{rank}.txt").write_text(
            f"group at exit: {dist.is_initialized()}"))
        engine = build({})
        for i in range(3):
            step(engine, i)
    elif mode == "sigterm":
        engine = build({"zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(out)}}})
        step(engine, 0)
        print("ready", flush=True)
        time.sleep(60)
    elif mode == "frozen":
        engine = build({"zeromem": {"timeout_s": 3}})
        step(engine, 0)
        if engine.comm.rank == 1:
            time.sleep(30)  # frozen after one step: rank 0 must name it
        began = time.monotonic()
        try:
            step(engine, 1)
        except RuntimeError as error:
            print(f"failed after {time.monotonic() - began:.1f}s: {error}", flush=True)
            os._exit(3)


if __name__ == "__main__":
    main()
