"""Host memory and step time of stage 3 with NVMe offload, as the issue-16 table measures them.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/bench_nvme_memory.py --width 1024 \
        --modes none,cpu,nvme,nvme_small [--init] [--steps 6] [--extra '{"zeromem": {...}}']
        [--disk-mb 256 --rounds 5]

16 `Linear(W, W)` layers, stage 3, fp32 AdamW, 2 gloo ranks (each mode in a fresh pair of
processes). Per rank: resident memory (VmRSS of /proc/self/status) right after `initialize`,
after the last step ("steady"), and its high-water mark (VmHWM), and the median step time.
With MALLOC_MMAP_THRESHOLD_=65536 glibc returns freed blocks at once, so RSS is what is held.
"peak" is training's high-water mark (reset after `initialize`), "init_peak" construction's;
"cpu" / "main_cpu" the median step's CPU time of the process (all its threads) and of its
main thread (the larger rank's), "faults" / "switches" its minor page faults and context
switches (fresh pages and I/O threads cost CPU on a box this small); "io" is rank 0's
swap I/O of the last step (`engine.offload.io_report()`: wait_s is the time it blocked
on it), "io_ranks" both ranks' bytes a step moved to and from storage, read from
/proc/self/io (the block layer's count, the same for both systems, not zeromem's ledger).

DeepSpeed side by side: a mode prefixed `deepspeed_` (`deepspeed_cpu`, `deepspeed_nvme`)
is DeepSpeed's own engine on the same model and JSON (DS_ACCELERATOR=cpu; run with a
Python that has deepspeed, and for NVMe its async_io op, which needs libaio: see
benchmarks/README.md). Its `vs_bound` is against `deepspeed_cpu`'s step.

Item 2 of issue 16 (at the disk's pace), with `--disk-mb N`: the disk's best read and
write rates under --nvme-path are measured first (bench_offload.raw_best: several
threads, deep queue, O_DIRECT, no fsync), and each NVMe row also gets
`io_s` = last step's bytes read / read rate + bytes written / write rate, over both ranks
(they share the one disk), `compute_s` =
the "cpu" mode's step (the same work with nothing on disk), and `vs_bound` = step /
max(compute_s, io_s) (goal <= 1.2). Modes run one after another: timings on a shared
machine are noisy, so `--rounds N` runs the modes N times in turn (each ratio against
the "cpu" run just before it) and ends with one summary line per mode: medians and ranges.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import zeromem  # noqa: E402
from measure import storage_bytes  # noqa: E402

MB = 1e6
DEEPSPEED = "deepspeed_"  # a mode's prefix: DeepSpeed's own engine runs it


def vm(key: str) -> float:
    """VmRSS / VmHWM of this process, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024 / MB
    return 0.0


class Stack(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def config(mode: str, path: str, extra: dict) -> dict:
    """The JSON both systems read; a `deepspeed_` mode is DeepSpeed's run of the same one."""
    mode = mode.removeprefix(DEEPSPEED)
    zero: dict = {"stage": 3}
    if mode == "cpu":
        zero |= {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    elif mode.startswith("nvme"):
        zero |= {"offload_optimizer": {"device": "nvme", "nvme_path": path},
                 "offload_param": {"device": "nvme", "nvme_path": path}}
        if mode == "nvme_small":
            zero["sub_group_size"] = 1_000_000
    # issue 16's runs: no clipping, the default then; DeepSpeed 0.19.8 and zeromem since
    # stop 49 clip at 1.0, and a clipped step waits for the whole gradient's norm
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
    return merged(cfg, extra)


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra`'s keys, nested blocks merged key by key (`--extra
    '{"zero_optimization": {"offload_optimizer": {"buffer_count": 12}}}'` keeps the device)."""
    out = dict(base)
    for key, value in extra.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if nested else value
    return out


def worker(rank: int, world: int, port: int, mode: str, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = config(mode, args.nvme_path, json.loads(args.extra))
    torch.manual_seed(0)
    if mode.startswith(DEEPSPEED):
        engine = deepspeed_engine(Stack(args.width, args.depth), cfg)
    elif args.init:
        with zeromem.Init(config=cfg):
            engine = zeromem.initialize(Stack(args.width, args.depth), cfg)
    else:
        engine = zeromem.initialize(Stack(args.width, args.depth), cfg)
    after_init, init_peak = vm("VmRSS"), vm("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts: training's peak
    times, cpu, main_cpu, faults, switches, disk = [], [], [], [], [], []
    bf16 = cfg.get("bf16", {}).get("enabled", False)  # the input in the parameters' dtype
    x = torch.randn(8, args.width, dtype=torch.bfloat16 if bf16 else torch.float32)
    for _ in range(args.steps):
        t, c, m = time.perf_counter(), time.process_time(), time.thread_time()
        r = resource.getrusage(resource.RUSAGE_SELF)
        before = storage_bytes()
        engine.backward(engine(x))
        engine.step()
        disk.append({k: v - before[k] for k, v in storage_bytes().items()})
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        main_cpu.append(time.thread_time() - m)
        r2 = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(r2.ru_minflt - r.ru_minflt)
        switches.append(r2.ru_nivcsw - r.ru_nivcsw + r2.ru_nvcsw - r.ru_nvcsw)
    out = {"rank": rank, "init": after_init, "init_peak": init_peak, "steady": vm("VmRSS"),
           "peak": vm("VmHWM"), "step": statistics.median(times[1:]),
           "cpu": statistics.median(cpu[1:]), "main_cpu": statistics.median(main_cpu[1:]),
           "faults": statistics.median(faults[1:]), "switches": statistics.median(switches[1:]),
           "io": engine.offload.io_report()["last_step"] if isinstance(engine, zeromem.Engine)
           else {},
           # writes left in flight at a step's end land in the next: the timed steps' mean
           "disk": {k: statistics.mean(d[k] for d in disk[1:]) for k in disk[0]}}
    queue.put(out)
    if isinstance(engine, zeromem.Engine):
        engine.close()
    dist.destroy_process_group()


def deepspeed_engine(model: torch.nn.Module, cfg: dict):
    """DeepSpeed's engine on the same model and JSON (`deepspeed_` modes)."""
    os.environ.update(LOCAL_RANK=os.environ["RANK"], DS_ACCELERATOR="cpu")
    import deepspeed
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def run(mode: str, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, mode, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    outs = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    if mode.startswith(DEEPSPEED):
        for leftover in Path(args.nvme_path).glob("zero_stage_3"):
            shutil.rmtree(leftover, ignore_errors=True)  # DeepSpeed's swap folders stay behind
    states = 16 * sum(args.width * args.width + args.width for _ in range(args.depth)) / 2 / MB
    return {"mode": mode, "states_mb": states,
            **{k: max(o[k] for o in outs)
               for k in ("init", "init_peak", "steady", "peak", "step", "cpu", "main_cpu",
                         "faults", "switches")},
            "io": next(o["io"] for o in outs if o["rank"] == 0),
            "io_ranks": {k: sum(o["disk"][k] for o in outs) for k in ("read_bytes", "written_bytes")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--modes", default="none,cpu,nvme,nvme_small")
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--init", action="store_true", help="build the model under zeromem.Init")
    ap.add_argument("--extra", default="{}", help="JSON merged into the config")
    ap.add_argument("--disk-mb", type=int, default=0, help="measure the disk first (MiB)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the modes this many times in turn; then print medians")
    args = ap.parse_args()
    if args.init and DEEPSPEED in args.modes:
        ap.error("--init builds under zeromem.Init: run the deepspeed_ modes without it")
    disk = None
    if args.disk_mb:
        from bench_offload import raw_best
        disk = raw_best(Path(args.nvme_path), args.disk_mb << 20)
        print(json.dumps({"disk_read_MBps": round(disk["read"] / MB), "disk_write_MBps":
                          round(disk["write"] / MB), "direct": disk["direct"]}), flush=True)
    rows: list[dict] = []
    for _ in range(args.rounds):
        rows += one_round(args, disk)
    if args.rounds > 1:
        for mode in args.modes.split(","):
            print(json.dumps(summary(mode, [r for r in rows if r["mode"] == mode])), flush=True)


def one_round(args, disk: dict | None) -> list[dict]:
    """Each mode once, in order. An NVMe row's bound uses this round's "cpu" step: the
    machine's speed drifts between runs, so each ratio compares runs made side by side."""
    compute_s: dict[str, float] = {}  # "" (zeromem) or DEEPSPEED -> its "cpu" step
    rows = []
    for mode in args.modes.split(","):
        r = run(mode, args)
        system, kind = (DEEPSPEED, mode[len(DEEPSPEED):]) if mode.startswith(DEEPSPEED) \
            else ("", mode)
        if kind == "cpu":
            compute_s[system] = r["step"]
        if disk is not None and kind.startswith("nvme"):
            io = r["io_ranks"]  # both ranks' bytes: one disk serves them
            r["io_s"] = io["read_bytes"] / disk["read"] + io["written_bytes"] / disk["write"]
            if system in compute_s:
                r["compute_s"] = compute_s[system]
                r["vs_bound"] = r["step"] / max(compute_s[system], r["io_s"])
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
              flush=True)
        rows.append(r)
    return rows


def summary(mode: str, rows: list[dict]) -> dict:
    """Median (and range) over the rounds of each figure a mode's rows share."""
    out: dict = {"summary": mode, "rounds": len(rows)}
    for key in ("steady", "peak", "step", "cpu", "io_s", "compute_s", "vs_bound"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = round(statistics.median(values), 3)
            out[key + "_range"] = [round(min(values), 3), round(max(values), 3)]
    return out


if __name__ == "__main__":
    main()
