"""Print the learning rate each optimizer step uses under DeepSpeed's or zeromem's schedulers.

Run with DeepSpeed (a test-data tool, never a zeromem dependency) and with zeromem:

    DS_ACCELERATOR=cpu /work/dsvenv/bin/python tools/print_scheduler_lrs.py deepspeed
    PYTHONPATH=src python tools/print_scheduler_lrs.py zeromem

Each schedule in SCHEDULES is built by `initialize` over a one-layer model with the
config below; the lr printed for step k is the optimizer's lr as step k runs (read
before `engine.step()`), for STEPS steps. tests/unit/test_schedulers.py holds
DeepSpeed's output as literal data and reads SCHEDULES from this file.
"""
from __future__ import annotations

import json
import os
import sys

import torch

STEPS = 10
WARMUP = {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 4}
SCHEDULES = {
    "WarmupLR log": ("WarmupLR", {**WARMUP, "warmup_type": "log"}),
    "WarmupLR linear": ("WarmupLR", {**WARMUP, "warmup_type": "linear"}),
    # no warmup_max_lr: DeepSpeed 0.19.8 warms up to each group's own lr (0.01 below)
    "WarmupLR to the optimizer's lr": ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_num_steps": 4,
                                                    "warmup_type": "linear"}),
    "WarmupDecayLR log": ("WarmupDecayLR", {**WARMUP, "warmup_type": "log", "total_num_steps": 8}),
    "WarmupDecayLR linear": ("WarmupDecayLR", {**WARMUP, "warmup_type": "linear",
                                               "total_num_steps": 8}),
    "WarmupCosineLR linear": ("WarmupCosineLR", {"warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                                                 "total_num_steps": 8, "cos_min_ratio": 0.01,
                                                 "warmup_type": "linear"}),
    "OneCycle": ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01,
                              "cycle_first_step_size": 3, "decay_lr_rate": 0.5,
                              "decay_step_size": 2}),
    "LRRangeTest": ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2,
                                    "lr_range_test_step_rate": 1.0}),
}


def config(kind: str, params: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "scheduler": {"type": kind, "params": params}, "steps_per_print": 1000}


def lrs(initialize, kind: str, params: dict) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    engine, *_ = initialize(model=model, model_parameters=model.parameters(),
                            config=config(kind, params))
    out = []
    for _ in range(STEPS):
        out.append(round(engine.get_lr()[0], 12))
        loss = engine(torch.ones(1, 2)).sum()
        engine.backward(loss)
        engine.step()
    return out


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    if sys.argv[1:] == ["deepspeed"]:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        initialize = deepspeed.initialize
    else:
        import zeromem.deepspeed as zds
        initialize = zds.initialize
    print(json.dumps({name: lrs(initialize, *spec) for name, spec in SCHEDULES.items()},
                     indent=1))


if __name__ == "__main__":
    main()
