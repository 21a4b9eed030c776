"""Make the DeepSpeed checkpoints under tests/data/deepspeed_checkpoints/ (run by hand, not in CI).

Needs DeepSpeed (a test-data tool, never a zeromem dependency); on CPU:

    python3 -m venv .venv-ds && .venv-ds/bin/pip install torch==2.13.0 deepspeed
    DS_ACCELERATOR=cpu .venv-ds/bin/python tools/make_deepspeed_checkpoints.py

For each case (ZeRO stage, world size, precision) it trains `tests/models.py`'s TinyLM
with real DeepSpeed (gloo) for SAVE_AT optimizer steps on `micro_batch` data, saves a
checkpoint, trains AFTER more steps and records, in `<case>/expected.json`:

- `losses`: the loss of every micro-batch j = rank * gas + micro of every step after the save
  (G micro-batches per step at every world size, so runs of any size see the same data);
- `states`: per trained parameter, a fingerprint (sum, sum of squares, first elements) of the
  fp32 master, exp_avg and exp_avg_sq at the save, read through DeepSpeed's own API, and Adam's
  step;
- `config`: the DeepSpeed config used (gradient_accumulation_steps for one rank).

DeepSpeed copies its conversion script into every checkpoint; it is removed here.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from models import TinyLM, micro_batch  # noqa: E402

OUT = ROOT / "tests" / "data" / "deepspeed_checkpoints"
G = 4  # micro-batches per optimizer step, whatever the world size
SAVE_AT, AFTER = 3, 3
CASES = [  # (stage, world size, precision)
    (1, 1, "fp32"), (2, 2, "fp32"), (3, 2, "fp32"),
    (1, 2, "bf16"), (2, 1, "bf16"), (3, 2, "bf16"),
]


def ds_config(stage: int, world_size: int, precision: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": G // world_size,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 5,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                              "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 1000,
    }


def fingerprint(t: torch.Tensor) -> dict:
    t = t.detach().float().flatten()
    return {"sum": t.sum().item(), "sumsq": (t * t).sum().item(), "head": t[:4].tolist()}


def train(engine, rank: int, gas: int, step: int) -> list[float]:
    losses = []
    for micro in range(gas):
        tokens, targets = micro_batch(step, rank * gas + micro, 0)
        loss = engine(tokens, targets, True)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def states(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[name] = {"master": fingerprint(safe_get_full_fp32_param(p)),
                     "exp_avg": fingerprint(safe_get_full_optimizer_state(p, "exp_avg")),
                     "exp_avg_sq": fingerprint(safe_get_full_optimizer_state(p, "exp_avg_sq"))}
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values()}
    assert len(steps) == 1, steps
    out["__step__"] = steps.pop()
    return out


def worker(rank: int, world_size: int, port: int, stage: int, precision: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    config = ds_config(stage, world_size, precision)
    torch.manual_seed(0)
    model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    gas = G // world_size
    for step in range(SAVE_AT):
        train(engine, rank, gas, step)
    engine.save_checkpoint(out)
    saved = states(engine)
    curve = []
    for step in range(SAVE_AT, SAVE_AT + AFTER):
        mine = torch.tensor(train(engine, rank, gas, step), dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        curve.append(torch.cat(every).tolist())  # micro-batch j = rank * gas + micro
    if rank == 0:
        config["gradient_accumulation_steps"] = G
        expected = {"stage": stage, "world_size": world_size, "precision": precision,
                    "save_at": SAVE_AT, "micro_batches_per_step": G, "config": config,
                    "losses": curve, "states": saved,
                    "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__}
        (Path(out) / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
        for script in Path(out).glob("*.py"):  # DeepSpeed copies its converter script here
            script.unlink()
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    for stage, world_size, precision in CASES:
        out = OUT / f"stage{stage}_ws{world_size}_{precision}"
        shutil.rmtree(out, ignore_errors=True)
        mp.spawn(worker, args=(world_size, free_port(), stage, precision, str(out)),
                 nprocs=world_size)
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{out.relative_to(ROOT)}: {size / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
