"""GPU benchmark: zeromem stages 0-3 against FSDP2 and DeepSpeed at GPT-2-medium size, bf16, NCCL.

    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_bench.py \
        [--systems zeromem-0,zeromem-1,zeromem-2,zeromem-3,fsdp2,deepspeed-3] [--trace DIR]

Model: examples/gpt.py at GPT-2-medium size (24 layers, width 1024, 16 heads, context 1024,
vocabulary 50304: ~354M parameters). Every system trains in bf16 (parameters and
communication; fp32 master weights where the system keeps them) with AdamW, one optimizer
step per micro-batch, defaults otherwise (zeromem chooses its own fetch units and bucket
sizes). Each system runs in this same process one after the other, with the model rebuilt
from seed 0 and the CUDA caching allocator emptied between them.

Per system (rank 0 prints; every rank measures): tokens/s over the timed steps (global:
all ranks' tokens) and `torch.cuda.max_memory_allocated` (the larger rank). With `--trace
DIR`, one timed step of each system is recorded with torch.profiler into
DIR/<system>-rank<r>.json (open in chrome://tracing or Perfetto): the reduce-scatter and
all-gather kernels should sit on their own streams, overlapping the compute kernels.

Not run in this repository's CI (no GPU there); see the README's benchmark section.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent / "src"))
from gpt import GPT, GPTConfig  # noqa: E402

MEDIUM = GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024)
LR = 3e-4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="zeromem-0,zeromem-1,zeromem-2,zeromem-3,fsdp2,"
                                             "deepspeed-1,deepspeed-2,deepspeed-3")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trace", type=Path, default=None, help="torch.profiler traces here")
    return parser.parse_args()


def ds_config(stage: int, micro_batch: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 9, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "overlap_comm": True}}


def build(system: str, micro_batch: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """One training step for `system` on a fresh GPT-2-medium; returns the loss."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = GPT(MEDIUM)
    family, _, stage = system.partition("-")
    if family == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        model.to(device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)

        def fsdp_step(ids: torch.Tensor) -> torch.Tensor:
            loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return fsdp_step
    if family == "deepspeed":
        import deepspeed
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(int(stage), micro_batch))[0]
    else:
        import zeromem
        engine = zeromem.initialize(model, ds_config(int(stage), micro_batch))
        if dist.get_rank() == 0 and engine.fetch_unit_report:
            print(engine.fetch_unit_report.splitlines()[0], flush=True)

    def engine_step(ids: torch.Tensor) -> torch.Tensor:
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss
    return engine_step


def measure(system: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step = build(system, args.micro_batch)
    g = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    ids = torch.randint(0, MEDIUM.vocab_size, (args.micro_batch, args.seq_len + 1),
                        device="cuda", generator=g)
    for _ in range(args.warmup):
        step(ids)
    torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step(ids)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if args.trace is not None:
        trace(system, step, ids, args.trace)
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = args.steps * args.micro_batch * args.seq_len * dist.get_world_size()
    return {"tokens_per_s": tokens / seconds, "max_memory_gib": float(peak) / 2 ** 30,
            "loss": float(loss)}


def trace(system: str, step: Callable, ids: torch.Tensor, out: Path) -> None:
    """One step under torch.profiler: the collectives' streams beside the compute stream."""
    from torch.profiler import ProfilerActivity, profile
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(ids)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / f"{system}-rank{dist.get_rank()}.json"))


def main() -> None:
    args = parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    rows = []
    for system in [s for s in args.systems.split(",") if s]:
        if system.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
            rows.append(f"| {system} | skipped: deepspeed not installed | |")
            continue
        result = measure(system, args)
        rows.append(f"| {system} | {result['tokens_per_s']:,.0f} | "
                    f"{result['max_memory_gib']:.2f} |")
        gc.collect()
    if rank == 0:
        print(f"\nGPT-2 medium ({sum(p.numel() for p in GPT(MEDIUM).parameters()):,} "
              f"parameters), bf16, {dist.get_world_size()} x {torch.cuda.get_device_name()}, "
              f"micro-batch {args.micro_batch} x {args.seq_len}\n")
        print("| system | tokens/s | max allocated GiB |\n|---|---|---|")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
