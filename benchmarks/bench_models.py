"""Step time of DDP, FSDP2, DeepSpeed and zeromem on several model shapes, as ratios to DDP.

    OMP_NUM_THREADS=1 python benchmarks/bench_models.py [--reps 3] [--out benchmarks/results]

(`make bench` runs it.) Two gloo ranks on this machine, fp32, AdamW, one optimizer step per
micro-batch. Every system runs with its defaults, the way a user would start:

    ddp              DistributedDataParallel + torch.optim.AdamW (the baseline, ratio 1.00)
    fsdp2            fully_shard on each block, then on the root
    deepspeed-S      deepspeed.initialize, ZeRO stage S (0-3), torch AdamW; when installed
    zeromem-S        zeromem.initialize, stage S, default config (fetch units chosen by zeromem)
    zeromem-3-blocks zeromem stage 3 with fetch_units=(the block class,): the hand-picked unit

Models: the demo GPT (examples/gpt.py) at three shapes, `small` (6 layers, width 256),
`deep` (32 layers, width 64: framework overhead dominates) and `wide` (2 layers, width
1024), and tiny Hugging Face GPT-2 and Llama built from configs (nothing downloaded).

How it measures: a *trial* is one system on every model, in one fresh pair of worker
processes (no system inherits another's heap, globals or patched classes). Trials go
round-robin over the systems for `--reps` repetitions, the order rotated each time, so
background load is shared. A step (forward, backward, optimizer step) is timed between
barriers; its time is the slower rank's. Reported: the median over all timed steps of all
repetitions, and its ratio to DDP's on the same model. Writes `bench_models.md` (the table)
and, with matplotlib installed, `bench_models.png` (bars) under `--out`. A system whose
library is missing is skipped with a note.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
SYSTEMS = ["ddp", "fsdp2", "deepspeed-0", "deepspeed-1", "deepspeed-2", "deepspeed-3",
           "zeromem-0", "zeromem-1", "zeromem-2", "zeromem-3", "zeromem-3-blocks"]
MODELS = ["small", "deep", "wide", "hf-gpt2", "hf-llama"]
GPT_SHAPES = {"small": dict(n_layer=6, n_embd=256, block_size=128),
              "deep": dict(n_layer=32, n_embd=64, block_size=32),
              "wide": dict(n_layer=2, n_embd=1024, block_size=64)}
MICRO_BATCH, HF_SEQ, VOCAB, LR = 8, 64, 256, 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="round-robin repetitions")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per model and rep")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--trial-timeout", type=float, default=600.0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # JSON spec: one rank of a trial
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- models


def build_model(name: str) -> tuple[Any, Any, type]:
    """(model, blocks list, block class) built from seed 0; forward(ids) -> loss."""
    import torch
    torch.manual_seed(0)
    if name in GPT_SHAPES:
        sys.path.insert(0, str(HERE.parent / "examples"))
        from gpt import GPT, Block, GPTConfig
        model = GPT(GPTConfig(**GPT_SHAPES[name]))
        return model, model.blocks, Block
    import transformers as t
    if name == "hf-gpt2":
        model = t.GPT2LMHeadModel(t.GPT2Config(
            n_embd=64, n_layer=2, n_head=2, n_positions=HF_SEQ, vocab_size=VOCAB,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        return model, model.transformer.h, type(model.transformer.h[0])
    model = t.LlamaForCausalLM(t.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_key_value_heads=1, vocab_size=VOCAB,
        max_position_embeddings=HF_SEQ, num_hidden_layers=2, num_attention_heads=2))
    return model, model.model.layers, type(model.model.layers[0])


def loss_fn(name: str) -> Callable[[Any, Any], Any]:
    if name in GPT_SHAPES:
        return lambda model, ids: model(ids[:, :-1], ids[:, 1:])
    return lambda model, ids: model(input_ids=ids, labels=ids).loss


def batches(name: str, rank: int, count: int) -> list:
    import torch
    seq = GPT_SHAPES[name]["block_size"] + 1 if name in GPT_SHAPES else HF_SEQ
    g = torch.Generator().manual_seed(rank)
    return [torch.randint(0, VOCAB, (MICRO_BATCH, seq), generator=g) for _ in range(count)]


# ----------------------------------------------------------------------------- systems


def build_system(system: str, model: Any, blocks: Any, block_class: type, loss: Callable
                 ) -> Callable[[Any], float]:
    """A function running one training step on a batch; returns the loss."""
    import torch
    if system in ("ddp", "fsdp2"):
        if system == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard
            for block in blocks:
                fully_shard(block)
            wrapped = fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

        def torch_step(ids: Any) -> float:
            out = loss(wrapped, ids)
            out.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(out)
        return torch_step
    family, stage = system.split("-")[:2]
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": int(stage)}}
    if family == "deepspeed":
        import deepspeed
        config["optimizer"]["params"]["torch_adam"] = True  # no compiled Adam op on CPU
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)[0]
    else:
        import zeromem
        units = (block_class,) if system.endswith("blocks") else ()
        engine = zeromem.initialize(model, config, fetch_units=units)

    def engine_step(ids: Any) -> float:
        out = loss(engine, ids)
        engine.backward(out)
        engine.step()
        return float(out)
    return engine_step


def run_trial(spec: dict) -> dict:
    """One rank of one trial: the system on every model; per model, the timed steps."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # DeepSpeed asserts it is set
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout"]))
    rank, out = dist.get_rank(), {}
    for name in spec["models"]:
        model, blocks, block_class = build_model(name)
        step = build_system(spec["system"], model, blocks, block_class, loss_fn(name))
        data = batches(name, rank, 3)
        seconds = []
        for i in range(spec["warmup"] + spec["steps"]):
            dist.barrier()
            started = time.perf_counter()
            step(data[i % len(data)])
            took = torch.tensor(time.perf_counter() - started)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step takes as long as its slower rank
            if i >= spec["warmup"]:
                seconds.append(float(took))
        out[name] = seconds
    dist.barrier()
    return out


def worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    try:
        result: dict = {"status": "ok", "seconds": run_trial(spec)}
    except Exception as error:  # reported through the result file
        import traceback
        result = {"status": "failed", "error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()[-3000:]}
    Path(spec["result"]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # some libraries' threads abort during interpreter teardown


# ----------------------------------------------------------------------------- coordinator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(system: str, args: argparse.Namespace, scratch: Path, tag: str) -> dict:
    """Both ranks of one trial as fresh processes; rank 0's result (or why there is none)."""
    port, procs, results = free_port(), [], []
    for rank in range(2):
        spec = {"system": system, "models": args.model_list, "warmup": args.warmup,
                "steps": args.steps, "timeout": args.trial_timeout,
                "result": str(scratch / f"{tag}-{rank}.json")}
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"),
                                               os.environ.get("PYTHONPATH", "")]))
        log = open(scratch / f"{tag}-{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log,
                      Path(spec["result"])))
    for proc, log, path in procs:
        try:
            proc.wait(timeout=args.trial_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        results.append(json.loads(path.read_text()) if path.exists() else
                       {"status": "failed", "error": "no result: " + Path(log.name).read_text()[-800:]})
    return next((r for r in results if r["status"] != "ok"), results[0])


def missing(systems: list[str], models: list[str]) -> dict[str, str]:
    """Why a system or model cannot run here (its library is not installed)."""
    out = {}
    if importlib.util.find_spec("deepspeed") is None:
        out.update({s: "deepspeed is not installed (pip install -e '.[bench]')"
                    for s in systems if s.startswith("deepspeed")})
    if importlib.util.find_spec("transformers") is None:
        out.update({m: "transformers is not installed" for m in models if m.startswith("hf")})
    return out


def table(medians: dict[str, dict[str, float]], systems: list[str], models: list[str]) -> str:
    """Markdown: one row per system, one column per model, step time / DDP's."""
    ddp = medians.get("ddp", {})
    lines = ["| system | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|",
             "| DDP step (ms) | " + " | ".join(f"{1e3 * ddp[m]:.0f}" if m in ddp else "-"
                                             for m in models) + " |"]
    for system in systems:
        cells = [f"{medians[system][m] / ddp[m]:.2f}" if m in medians.get(system, {}) and m in ddp
                 else "-" for m in models]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(medians: dict[str, dict[str, float]], systems: list[str], models: list[str],
         path: Path) -> bool:
    """Grouped bars of step time / DDP per model; False without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ddp = medians["ddp"]
    shown = [s for s in systems if s in medians]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(models)), 4.5))
    width = 0.8 / len(shown)
    for i, system in enumerate(shown):
        xs = [j + i * width for j, m in enumerate(models) if m in medians[system] and m in ddp]
        ys = [medians[system][m] / ddp[m] for m in models if m in medians[system] and m in ddp]
        ax.bar(xs, ys, width, label=system)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
    ax.set_ylabel("step time / DDP (lower is faster)")
    ax.set_title("2 gloo ranks on CPU, fp32 AdamW, median step time")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    systems = [s for s in args.systems.split(",") if s]
    models = [m for m in args.models.split(",") if m]
    skipped = missing(systems, models)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}", flush=True)
    systems = [s for s in systems if s not in skipped]
    args.model_list = [m for m in models if m not in skipped]
    seconds: dict[str, dict[str, list[float]]] = {s: {} for s in systems}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_models_") as scratch:
        for rep in range(args.reps):
            shift = rep % len(systems)
            for system in systems[shift:] + systems[:shift]:
                began = time.perf_counter()
                result = launch(system, args, Path(scratch), f"{rep}-{system}")
                print(f"rep {rep} {system:<18} {result['status']:<7} "
                      f"{time.perf_counter() - began:5.1f}s", flush=True)
                if result["status"] != "ok":
                    print(result.get("error", "") + result.get("traceback", ""), flush=True)
                    continue
                for model, times in result["seconds"].items():
                    seconds[system].setdefault(model, []).extend(times)
    medians = {s: {m: statistics.median(t) for m, t in per.items()} for s, per in seconds.items()}
    notes = [f"skipped {name}: {why}" for name, why in skipped.items()]
    text = (table(medians, systems, args.model_list) + "\n\n"
            + f"Step time / DDP's, median of {args.reps} interleaved repetitions x {args.steps} "
              f"steps, 2 gloo ranks, {time.perf_counter() - started:.0f}s wall, load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs."
            + "".join(f"\n{n}" for n in notes) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_models.md").write_text(text)
    (args.out / "bench_models.json").write_text(json.dumps(seconds, indent=1))
    print("\n" + text)
    if "ddp" in medians and plot(medians, systems, args.model_list, args.out / "bench_models.png"):
        print(f"chart: {args.out / 'bench_models.png'}")
    print(f"table: {args.out / 'bench_models.md'}")


if __name__ == "__main__":
    main()
