"""The planner's host memory against resident memory (RSS) measured on this machine.

    python benchmarks/bench_plan_rss.py [--nvme-path DIR] [--layers 6] [--width 256]

For each offload setup, on 2 gloo ranks started with MALLOC_MMAP_THRESHOLD_=65536
(so that freed blocks go back to the system at once): build the demo GPT without
an engine, take VmRSS as the baseline, build the engine from the setup's config,
run 2 steps, and take VmRSS again (after one warm-up engine, see `_measure`). On
this CPU machine the "device" is host memory too, so the engine's whole footprint
shows in RSS; the prediction
compared is therefore the planner's

    device model states + host bytes (`predict_memory`) - the model's own parameters

(the engine replaces the module's parameter storage with its flat buffers, which
the device figure already counts). The ledger (`engine.memory_report()`, the
tensors the engine holds) is printed beside them; RSS - ledger is what no tensor
census sees (gloo's buffers, the swap I/O threads, allocator slack). The
communication buffers (temporary: not in RSS after the step) are printed planned,
by part, beside the engine's own peak figure.

Two predictions are printed: for GPUs (`predict_memory`'s default, device "cuda")
and for this machine (device="cpu", what `zeromem plan --calibrate` plans here).
They differ where the CPU is the device: an fp32 reduced gradient shard on the
"device" is already the host gradient, so the engine keeps it once where a GPU run
holds it twice. The error is this machine's plan against RSS. NVMe swap pools are
allocated uninitialised (unpinned without CUDA), so RSS counts only the pages the
step has touched.
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

from zeromem.planning.calibrate import run_ranks  # noqa: E402
from zeromem.planning.planner import predict_memory, shape_of  # noqa: E402

SETUPS = {"stage 2 (no offload)": (2, None, None), "stage 2, opt:cpu": (2, "cpu", None),
          "stage 3, opt:cpu, param:cpu": (3, "cpu", "cpu"), "stage 2, opt:nvme": (2, "nvme", None),
          "stage 3, opt:nvme, param:nvme": (3, "nvme", "nvme")}


def config(name: str, path: str) -> dict:
    stage, optimizer, param = SETUPS[name]
    zero: dict = {"stage": stage}
    if optimizer:
        zero["offload_optimizer"] = {"device": optimizer, "nvme_path": path}
    if param:
        zero["offload_param"] = {"device": param, "nvme_path": path}
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.MULTILINE).group(1)) * 1024


def _measure(rank: int, world: int, gpt: GPTConfig, path: str, names: list[str]) -> dict:
    import zeromem
    out = {}
    # The first engine of a process also pays one-time costs (gloo's and autograd's
    # buffers and threads, lazily loaded kernels: about 19 MB here); a warm-up engine
    # takes them before any baseline.
    for name in [names[0]] + names:
        torch.manual_seed(0)
        model = GPT(gpt)
        gc.collect()
        base = rss_bytes()
        engine = zeromem.initialize(model, config(name, path))
        del model
        for _ in range(2):
            tokens = torch.randint(0, 256, (2, gpt.block_size))
            engine.backward(engine(tokens, tokens))
            engine.step()
        gc.collect()
        held = engine.memory_report().to_dict()["held"]
        ledger = sum(b for c, places in held.items() if c != "comm_buffers"
                     for place, b in places.items() if place in ("device", "host"))
        out[name] = {"rss": rss_bytes() - base, "ledger": ledger,  # the warm-up's is replaced
                     "buffers": engine.comm.buffer_bytes_peak}
        engine.close()
        del engine
        gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    gpt = GPTConfig(n_layer=args.layers, n_embd=args.width)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc as each spawned rank starts
    with torch.device("meta"):
        shape = shape_of(GPT(gpt))
    measured = run_ranks(_measure, 2, (gpt, args.nvme_path, list(SETUPS)), timeout_s=1800)
    own = 4 * sum(shape.param_numels)  # the model's fp32 parameters, in the baseline
    print(f"demo GPT {shape.psi / 1e6:.1f}M parameters, fp32, 2 gloo ranks; MB per rank "
          "(rank 0 / rank 1 measured)")
    print(f"{'setup':<32}{'for GPUs':>10}{'this CPU':>10}{'ledger':>14}{'RSS':>16}"
          f"{'error vs RSS':>14}{'comm buffers planned':>22}{'engine':>8}")
    for name in SETUPS:
        gpu = predict_memory(shape, config(name, args.nvme_path), 2, backend="gloo")
        p = predict_memory(shape, config(name, args.nvme_path), 2, backend="gloo", device="cpu")
        predicted = p.model_state_bytes + p.host_bytes - own
        rss = [r[name]["rss"] for r in measured]
        ledger = [r[name]["ledger"] - own for r in measured]
        error = predicted / max(rss) - 1
        print(f"{name:<32}{(gpu.model_state_bytes + gpu.host_bytes - own) / 1e6:>10.1f}"
              f"{predicted / 1e6:>10.1f}"
              f"{ledger[0] / 1e6:>7.1f}/{ledger[1] / 1e6:<6.1f}"
              f"{rss[0] / 1e6:>8.1f}/{rss[1] / 1e6:<7.1f}{error:>+13.1%}"
              f"{p.comm_buffers / 1e6:>22.2f}{measured[0][name]['buffers'] / 1e6:>8.2f}  "
              + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in p.comm.items()))


if __name__ == "__main__":
    main()
