"""Train the demo GPT beyond host memory: ZeRO-Infinity under a host budget.

    torchrun --standalone --nproc_per_node 2 examples/train_nvme.py [--host-budget-mb 8]

ZeRO-Infinity's point (arXiv 2104.07857, section 5): a model's states need not fit in
host memory. Here stage 3 keeps the bf16 parameter shards, the fp32 master weights,
Adam's two moments and the reduced gradients in swap files under `--nvme-path` (one
directory per rank), and the only host memory offload holds is two pools sized from
one budget, `zeromem.offload_host_budget_bytes` (offload/budget.py):

    parameter pool   offload_param.buffer_count buffers, shard i always in buffer
                     i % buffer_count, each the largest shard it serves
    optimizer pool   what the budget leaves, cut into sub-groups read ahead / stepped /
                     written behind

The model is built under `zeromem.Init`, which writes each parameter's shard to
`--nvme-path` as it is made, and `initialize` writes each unit's shard and fp32 master
as it builds the unit: no rank ever holds the model's states, not even while building.
The model is chosen so that its states per rank (16 bytes per parameter / N_d) are at
least 4x the budget. At the end each rank prints the host and NVMe bytes its memory
ledger holds beside what the planner (`zeromem plan`, planning.predict_memory) predicted
for the same model and config, and checks the claims: states >= 4x budget, host bytes
within the budget, ledger within 10% of the plan. Data: CPython's pydoc text, as in examples/train.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import zeromem  # noqa: E402
from gpt import GPT, GPTConfig, count_parameters  # noqa: E402
from train import batch, load_text  # noqa: E402
from zeromem.planning.planner import predict_memory, shape_of  # noqa: E402

MB = 1e6
STATE_BYTES = 16  # per parameter: bf16 param 2 + bf16 grad 2 + fp32 master, m, v 12


def nvme_config(nvme_path: str, budget_bytes: int, micro_batch: int) -> dict:
    """Stage 3, optimizer and parameters on NVMe; pools from the budget (no sub_group_size)."""
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": dict(nvme),
                                  "offload_param": dict(nvme)},
            "zeromem": {"offload_host_budget_bytes": budget_bytes}}


def ledger_bytes(engine) -> tuple[int, int]:
    """(host bytes, NVMe bytes) this rank's memory ledger holds."""
    held = engine.memory_report().held
    return (sum(places.get("host", 0) for places in held.values()),
            sum(places.get("nvme", 0) for places in held.values()))


def run(args: argparse.Namespace, world: int, rank: int) -> dict:
    """Build, train `args.steps` steps, and return this rank's figures (see `check`)."""
    model_config = GPTConfig(block_size=args.seq, n_layer=args.layers, n_embd=args.width)
    budget = int(args.host_budget_mb * 2**20)
    config = nvme_config(args.nvme_path, budget, args.micro_batch)
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shape = GPT(model_config)  # sizes only, no storage
    psi = count_parameters(shape)
    torch.manual_seed(0)
    with zeromem.Init(config=config):  # each shard written to --nvme-path as it is made
        model = GPT(model_config)
    engine = zeromem.initialize(model, config)  # each unit's shard and master likewise
    try:
        train(engine, args, rank)
        host, nvme = ledger_bytes(engine)
    finally:
        engine.close()  # removes this rank's swap directory
    predicted = predict_memory(shape_of(shape), config, world)
    return {"psi": psi, "states": STATE_BYTES * psi / world, "budget": budget, "host": host,
            "nvme": nvme, "plan_host": predicted.host_bytes, "plan_nvme": predicted.nvme_bytes}


def train(engine, args: argparse.Namespace, rank: int) -> None:
    data = load_text()
    generator = torch.Generator().manual_seed(1234 + rank)
    start = time.perf_counter()
    for step in range(args.steps):
        tokens, targets = batch(data, args.micro_batch, args.seq, generator)  # each (B, T)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            io = engine.offload.io_report()["last_step"]
            print(f"step {step:3d}  loss {loss.item():.3f}  "
                  f"{(time.perf_counter() - start) / (step + 1):.2f} s/step  disk read "
                  f"{io['read_bytes'] / MB:.0f} MB, written {io['written_bytes'] / MB:.0f} MB, "
                  f"waited {io['wait_s']:.2f} s")


def check(out: dict) -> list[str]:
    """The example's two claims, as failures (empty: both hold)."""
    failures = []
    if out["states"] < 4 * out["budget"]:
        failures.append(f"model states {out['states'] / MB:.1f} MB < 4x the budget")
    if out["host"] > out["budget"]:
        failures.append(f"host bytes {out['host']:,} exceed the budget {out['budget']:,}")
    for place in ("host", "nvme"):
        if abs(out[place] - out[f"plan_{place}"]) > 0.1 * out[f"plan_{place}"]:
            failures.append(f"{place} bytes {out[place]:,} not within 10% of the plan's "
                            f"{out[f'plan_{place}']:,.0f}")
    return failures


def report(rows: list[dict]) -> None:
    first = rows[0]
    print(f"\nGPT {first['psi']:,} parameters on {len(rows)} rank(s): model states "
          f"{first['states'] / MB:.1f} MB per rank = {first['states'] / first['budget']:.1f}x "
          f"the host budget of {first['budget'] / MB:.1f} MB")
    print(f"{'rank':<6}{'host MB':>9}{'plan':>9}{'NVMe MB':>10}{'plan':>9}")
    for r, out in enumerate(rows):
        print(f"{r:<6}{out['host'] / MB:>9.2f}{out['plan_host'] / MB:>9.2f}"
              f"{out['nvme'] / MB:>10.2f}{out['plan_nvme'] / MB:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", default="/tmp/zeromem-nvme")
    parser.add_argument("--host-budget-mb", type=float, default=8.0, help="MiB per rank")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    out = run(args, world, rank)
    rows = [out]
    if world > 1:
        rows = [None] * world
        dist.all_gather_object(rows, out)
    if rank == 0:
        report(rows)
    failures = [f"rank {r}: {f}" for r, row in enumerate(rows) for f in check(row)]
    zeromem.shutdown()  # collectives finished and dropped, then the group ends: a clean exit
    if failures:
        raise SystemExit("\n".join(failures))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
