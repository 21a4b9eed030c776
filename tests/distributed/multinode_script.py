"""A stage-3 job for test_multinode.py, run under torchrun (one node or two agents as "nodes").

    multinode_script.py MODE OUT_DIR

MODE `job`: 5 optimizer steps; a checkpoint after step 3 (`OUT_DIR/ckpt`, written by
every rank of every node); each rank writes `job<rank>.json`: its losses and what it
knows of its place (global, local and node rank, device, NVMe swap directory).
MODE `resume`: the same 5 steps from scratch (`fresh<rank>.json`), then a second
engine loads the checkpoint and runs steps 4 and 5 (`resumed<rank>.json`).
Data depend on (global rank, step) only, so a 2-node job and a 1-node job of the
same world size see the same batches.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import zeromem
from zeromem.hybrid.mesh import NodeLayout

STEPS, SAVE_AFTER = 5, 3


def build(out: Path) -> zeromem.Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    swap = out / f"swap-{os.environ.get('GROUP_RANK', 0)}"  # each "node" names its own disk
    swap.mkdir(exist_ok=True)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "nvme",
                                                          "nvme_path": str(swap)}},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zeromem": {"timeout_s": 60}}
    return zeromem.initialize(model, config)


def step(engine: zeromem.Engine, index: int) -> float:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + index)
    loss = engine(torch.randn(2, 8, generator=g)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def place(engine: zeromem.Engine) -> dict:
    layout = engine.comm.layout  # what initialize read from torchrun's LOCAL_WORLD_SIZE
    assert isinstance(layout, NodeLayout)
    rank = dist.get_rank()
    return {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]),
            "group_rank": int(os.environ["GROUP_RANK"]), "node": layout.node_of(rank),
            "layout_local_rank": layout.local_rank_of(rank), "device": str(engine.device),
            "swap_dir": Path(engine.offload.spaces[0].dir).name}


def job(out: Path) -> None:
    engine = build(out)
    losses = []
    for i in range(STEPS):
        losses.append(step(engine, i))
        if i + 1 == SAVE_AFTER:
            engine.save_checkpoint(out / "ckpt", tag="step3")
    info = {"losses": losses, **place(engine)}
    engine.close()
    (out / f"job{dist.get_rank()}.json").write_text(json.dumps(info))


def resume(out: Path) -> None:
    engine = build(out)
    fresh = [step(engine, i) for i in range(STEPS)]
    engine.close()
    engine = build(out)
    engine.load_checkpoint(out / "ckpt", tag="step3")
    resumed = [step(engine, i) for i in range(SAVE_AFTER, STEPS)]
    engine.close()
    rank = dist.get_rank()
    (out / f"fresh{rank}.json").write_text(json.dumps(fresh))
    (out / f"resumed{rank}.json").write_text(json.dumps(resumed))


if __name__ == "__main__":
    {"job": job, "resume": resume}[sys.argv[1]](Path(sys.argv[2]))
    zeromem.shutdown()
