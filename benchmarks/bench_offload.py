"""Offload benchmarks: swap I/O against the raw disk, the CPU optimizer step, stage 3 with NVMe.

    python benchmarks/bench_offload.py [--nvme-path /tmp] [--disk-mb 1024] [--quick]

Three measurements, printed as one table (and saved as JSON with `--out`):

1. Disk. The disk's best under `--nvme-path`, measured in this run: write then
   read with several shapes (threads x request size, every thread's request in
   flight: a deep queue), O_DIRECT where the filesystem allows it, and no fsync
   the swapper does not pay (with O_DIRECT none; buffered, one fdatasync, as the
   swapper syncs each write); per operation the best shape counts. Against it,
   zeromem's swapper (offload/nvme.py: AsyncIO thread pool, block-sized
   pwritev/preadv on O_DIRECT files) writing and reading the same number of bytes
   as `--record-mb` records from a pool of 4 aligned buffers, 4 records in flight,
   as the NVMe optimizer does. Raw and swapper interleaved, the median of `--reps`
   rounds. Target: swapper >= 80 % of raw. A virtual machine's host cache can
   serve reads of fresh data (the table prints that note).
2. CPU optimizer. AdamW over `--numel` fp32 parameters: torch's fused and
   foreach CPU kernels and the single-tensor loop, zeromem's sub-group step
   (torch's functional fused kernel on `sub_group_size` views, what the NVMe path
   runs), and the whole NVMe-offloaded step including its swap I/O. Beside them
   the memory-bandwidth bound: a large torch copy measures bytes/s (read + write),
   and AdamW touches ~28 bytes per parameter (reads p, g, m, v; writes p, m, v).
   A copy into another buffer also pays write-allocate reads of the destination,
   which AdamW's in-place updates do not, so a second bound uses an in-place
   read-modify-write (`add_`);
   and, for the NVMe step, the swapper's I/O bound. All at 1 thread and at torch's
   default thread count: on a shared machine the multi-threaded kernels lose most
   to oversubscription (each parallel region waits for its slowest thread).
3. Stage 3 step time (forward + backward + step) of the demo GPT on 2 gloo ranks
   (mp.spawn): no offload, CPU optimizer offload, NVMe optimizer offload, and NVMe
   optimizer + parameter offload with 2 parameter buffers for more units, so that
   the shards are read from disk again at every forward and backward (the counts
   are printed), all alive at once and stepped in turn (so machine noise is
   shared). Median over the timed steps of the slower rank, with the last step's
   swap I/O from the run report (`engine.offload.io_report()`).
4. DeepSpeed's ZeRO-Infinity on the same GPT and batch (optimizer and parameters
   on NVMe, DS_ACCELERATOR=cpu), where its async I/O op builds (libaio); else a
   note saying why it was skipped. `--deepspeed-path` names a `pip install
   --target` folder when deepspeed is not installed in this environment.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "examples"))

from zeromem.offload.nvme import AsyncIO, BufferPool, SwapSpace, aligned_empty  # noqa: E402
from zeromem.offload.updates import adam_update  # noqa: E402

MB = 1 << 20


# ---------------------------------------------------------------- 1. disk

RAW_SHAPES = ((1, 8), (4, 1), (8, 1), (16, 1), (8, 4))  # (threads = requests in flight, MiB)


def _open_direct(path: Path) -> tuple[int, bool]:
    """(fd, direct): O_DIRECT where the filesystem takes it (probed with an aligned write)."""
    if hasattr(os, "O_DIRECT"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        try:
            os.pwritev(fd, [memoryview(aligned_empty(4096).zero_().numpy())], 0)
            return fd, True
        except OSError:
            os.close(fd)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC), False


def raw_pass(path: Path, total: int, block: int, threads: int) -> dict:
    """Write then read `total` bytes in `block` requests, `threads` of them in flight.

    The disk's best, not a strawman: several threads keep a deep queue, O_DIRECT where
    the filesystem allows it, and no fsync: with O_DIRECT the data is on the device when
    a write returns, and the swapper pays none either. Where O_DIRECT is refused, the
    swapper pays an fdatasync per write, so the raw pass pays one at the end, and reads
    are preceded by POSIX_FADV_DONTNEED so that they come from the disk, not the cache.
    """
    from concurrent.futures import ThreadPoolExecutor
    fd, direct = _open_direct(path)
    bufs = [aligned_empty(block).random_(0, 256) for _ in range(threads)]
    views = [memoryview(b.numpy()) for b in bufs]
    offsets = range(0, total, block)

    def run(call) -> float:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i_off: call(fd, [views[i_off[0] % threads]], i_off[1]),
                          enumerate(offsets)))
        return time.perf_counter() - start

    try:
        os.posix_fallocate(fd, 0, total)
        write_s = run(os.pwritev)
        if not direct:
            start = time.perf_counter()
            os.fdatasync(fd)
            write_s += time.perf_counter() - start
            os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)
        read_s = run(os.preadv)
    finally:
        os.close(fd)
        os.unlink(path)
    return {"write": total / write_s, "read": total / read_s, "direct": direct}


def raw_best(root: Path, total: int) -> dict:
    """Each shape of RAW_SHAPES once; per operation the best (and the shape that gave it)."""
    best: dict = {"direct": None}
    for threads, mib in RAW_SHAPES:
        r = raw_pass(root / f"zeromem-raw-{os.getpid()}", total, mib * MB, threads)
        best["direct"] = r["direct"]
        for op in ("write", "read"):
            if r[op] > best.get(op, 0):
                best[op], best[op + "_shape"] = r[op], f"{threads} x {mib} MiB"
    return best


def swap_pass(root: Path, total: int, record: int, aio_threads: int, block: int) -> dict:
    """zeromem's swapper: `record`-byte requests from a 4-buffer pool, 4 in flight."""
    io = AsyncIO(block_size=block, threads=aio_threads)
    space = SwapSpace(root, 0, io)
    try:
        f = space.file("bench.swp", total)
        pool = BufferPool(4, record)
        for b in pool.free:
            b.random_(0, 256)
        times = {}
        for op in ("write", "read"):
            start = time.perf_counter()
            in_flight = []
            for off in range(0, total, record):
                if len(in_flight) == pool.count:
                    buf, handle = in_flight.pop(0)
                    handle.wait()
                    pool.release(buf)
                buf = pool.acquire()
                in_flight.append((buf, getattr(f, op)(buf, off)))
            for buf, handle in in_flight:
                handle.wait()
                pool.release(buf)
            # no fsync: O_DIRECT writes are on the device when they complete, and buffered
            # ones were fdatasync'ed by the swapper itself (SwapFile.write)
            times[op] = time.perf_counter() - start
        return {"write": total / times["write"], "read": total / times["read"], "direct": f.direct}
    finally:
        space.close()


def bench_disk(args) -> dict:
    total = args.disk_mb * MB
    rounds = {"raw": [], "swap": []}
    for _ in range(args.reps):
        rounds["raw"].append(raw_best(Path(args.nvme_path), total))
        rounds["swap"].append(swap_pass(Path(args.nvme_path), total, args.record_mb * MB,
                                        args.aio_threads, args.aio_block_mb * MB))
    out = {}
    for kind, runs in rounds.items():
        out[kind] = {op: statistics.median(r[op] for r in runs) for op in ("write", "read")}
        out[kind]["direct"] = runs[0]["direct"]
        if kind == "raw":  # the shape of the median round's best
            for op in ("write", "read"):
                out[kind][op + "_shape"] = sorted(runs, key=lambda r: r[op])[len(runs) // 2][
                    op + "_shape"]
    return out


# ---------------------------------------------------------------- 2. CPU optimizer

def time_steps(step, reps: int) -> float:
    step()  # warm-up (lazy state)
    step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_adamw(numel: int, reps: int, **kernel) -> float:
    p = torch.zeros(numel)
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kernel)
    return numel / time_steps(opt.step, reps)


def subgroup_adamw(numel: int, reps: int, sub_group: int) -> float:
    """zeromem's NVMe kernel without I/O: functional fused AdamW, one call per sub-group."""
    p, g, m, v = torch.zeros(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
             "amsgrad": False, "maximize": False, "decoupled_weight_decay": True}
    count = [0]

    def step() -> None:
        for a in range(0, numel, sub_group):
            s = slice(a, min(a + sub_group, numel))
            adam_update(group, [p[s]], [g[s]], {"exp_avg": [m[s]], "exp_avg_sq": [v[s]]},
                        count[0])
        count[0] += 1

    return numel / time_steps(step, reps)


def nvme_adamw(numel: int, reps: int, sub_group: int, root: str, buffers: int) -> float:
    """The whole NVMe-offloaded step (swap in, fused step, swap out) on one rank."""
    import zeromem
    model = torch.nn.Linear(numel // 1024, 1024, bias=False)
    engine = zeromem.initialize(model, {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 1, "sub_group_size": sub_group, "offload_optimizer": {
            "device": "nvme", "nvme_path": root, "buffer_count": buffers,
            "pipeline_read": True, "pipeline_write": True}}})
    try:
        for grad in engine.offload.masters.host_grads.buffers.values():
            grad.normal_()
        return engine.psi / time_steps(engine.optimizer.step, reps)
    finally:
        engine.close()


def memcpy_bandwidth(nbytes: int, reps: int) -> float:
    """Bytes/s a large torch copy moves (each byte read once and written once)."""
    src = torch.empty(nbytes // 4).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / time_steps(lambda: dst.copy_(src), reps)


def inplace_bandwidth(nbytes: int, reps: int) -> float:
    """Bytes/s of an in-place read-modify-write (`add_`): no write-allocate traffic, like AdamW."""
    t = torch.empty(nbytes // 4).normal_()
    return 2 * nbytes / time_steps(lambda: t.add_(1.0), reps)


def bench_optimizer(args, disk: dict) -> dict:
    """Every kernel at 1 thread and at all threads (torch's default), same sizes."""
    n, reps, out = args.numel, args.reps, {}
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        bandwidth = memcpy_bandwidth(max(n * 4, 256 * MB), reps)
        out[threads] = {
            "torch AdamW fused": torch_adamw(n, reps, fused=True),
            "torch AdamW foreach": torch_adamw(n, reps, foreach=True),
            "torch AdamW single-tensor": torch_adamw(n, reps, foreach=False),
            "zeromem sub-group step (no I/O)": subgroup_adamw(n, reps, args.sub_group),
            "zeromem NVMe step (with I/O)": nvme_adamw(n, reps, args.sub_group, args.nvme_path,
                                                       args.buffer_count),
            "memory-bandwidth bound (28 B/param)": bandwidth / 28,
            "in-place r+w bound (28 B/param)": inplace_bandwidth(max(n * 4, 256 * MB), reps) / 28,
            "memcpy bytes/s": bandwidth,
        }
    torch.set_num_threads(default_threads)
    # fp32 NVMe step: m and v (8 B/param) read and written at the swapper's measured rates,
    # one after the other, or overlapped (the pipeline overlaps them; the disk may not)
    read, write = disk["swap"]["read"], disk["swap"]["write"]
    for row in out.values():
        row["NVMe I/O bound, serial (8+8 B/param)"] = 1 / (8 / read + 8 / write)
        row["NVMe I/O bound, overlapped"] = min(read, write) / 8
    return out


# ---------------------------------------------------------------- 3. stage 3 on 2 ranks

def stage3_configs(root: str, sub_group: int) -> dict[str, dict]:
    nvme_opt = {"device": "nvme", "nvme_path": root, "buffer_count": 9,
                "pipeline_read": True, "pipeline_write": True}
    return {
        "stage 3": {},
        "stage 3 + cpu optimizer": {"offload_optimizer": {"device": "cpu"}},
        "stage 3 + nvme optimizer": {"offload_optimizer": nvme_opt, "sub_group_size": sub_group},
        "stage 3 + nvme optimizer + params": {
            "offload_optimizer": nvme_opt, "sub_group_size": sub_group,
            # 2 buffers for 6+ units: every forward and backward reads the shards from disk again
            "offload_param": {"device": "nvme", "nvme_path": root, "buffer_count": 2}},
    }


def stage3_worker(rank: int, world: int, port: int, root: str, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import zeromem
    from gpt import GPT, Block, GPTConfig
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    engines, times = {}, {}
    try:
        for name, zero in stage3_configs(root, args.sub_group).items():
            torch.manual_seed(0)
            model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.width))
            engines[name] = zeromem.initialize(model, {
                "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 2_000_000,
                                      **zero}}, fetch_units=(Block,))
            times[name] = []
        gen = torch.Generator().manual_seed(rank)
        for step in range(args.warmup + args.steps):  # configurations interleaved: shared noise
            tokens = torch.randint(0, 256, (4, 128), generator=gen)
            for name, engine in engines.items():
                dist.barrier()
                start = time.perf_counter()
                engine.backward(engine(tokens, tokens))
                engine.step()
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's time
                if step >= args.warmup:
                    times[name].append(float(elapsed))
        queue.put((rank, {name: {"step_s": statistics.median(t), "psi": engines[name].psi,
                                 **disk_traffic(engines[name])} for name, t in times.items()}))
    finally:
        for engine in engines.values():
            engine.close()
        dist.destroy_process_group()


def disk_traffic(engine) -> dict:
    """The last step's swap I/O (the run report) and how parameter shards were fetched."""
    if not getattr(engine.offload, "spaces", None):
        return {}
    out = {"io": engine.offload.io_report()["last_step"]}
    counts = getattr(engine.offload.params, "counts", None)
    if counts is not None:  # since construction: reads from disk vs units
        out["param_reads"] = counts["read_ahead"] + counts["on_demand"]
        out["param_in_memory"] = counts["in_memory"]
        out["units"] = len(engine.stage3.units)
    return out


def bench_stage3(args) -> dict:
    return spawn_pair(stage3_worker, args)


def spawn_pair(worker, args) -> dict:
    """Run `worker` on 2 spawned gloo ranks; rank 0's result."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    root = tempfile.mkdtemp(prefix="zeromem-bench-", dir=args.nvme_path)
    procs = [ctx.Process(target=worker, args=(r, 2, port, root, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    shutil.rmtree(root, ignore_errors=True)  # DeepSpeed leaves its swap folders behind
    return results[0]


# ---------------------------------------------------------------- 4. DeepSpeed side by side

def deepspeed_aio(ds_path: str | None) -> str | None:
    """None if DeepSpeed's async I/O op builds here (libaio), else why not (a skip note)."""
    if ds_path:
        sys.path.insert(0, ds_path)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as e:
        return f"deepspeed is not installed ({e}); pip install deepspeed, then --deepspeed-path"
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        return "DeepSpeed's async_io op is not compatible here (libaio-dev missing?)"
    try:
        builder.load(verbose=False)
    except Exception as e:  # a failed JIT build: say so, do not stop the benchmark
        return f"DeepSpeed's async_io op did not build: {type(e).__name__}: {e}"
    return None


def deepspeed_worker(rank: int, world: int, port: int, root: str, args, queue) -> None:
    """DeepSpeed's ZeRO-Infinity (optimizer and parameters on NVMe) on the same GPT and batch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    if args.deepspeed_path:
        sys.path.insert(0, args.deepspeed_path)
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    from gpt import GPT, GPTConfig
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.width))
    nvme = {"device": "nvme", "nvme_path": root}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3, "stage3_prefetch_bucket_size": 2_000_000,
            "sub_group_size": args.sub_group,
            "offload_optimizer": {**nvme, "buffer_count": 4, "pipeline_read": True,
                                  "pipeline_write": True},
            # DeepSpeed asserts "Not enough buffers" below one buffer per parameter in flight
            "offload_param": {**nvme, "buffer_count": args.deepspeed_param_buffers,
                              "buffer_size": 1 << 20}}})
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, 256, (4, 128), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(tokens, tokens))
        engine.step()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(float(elapsed))
    queue.put((rank, {"step_s": statistics.median(times)}))
    dist.destroy_process_group()


def bench_deepspeed(args) -> dict:
    """DeepSpeed's NVMe step beside zeromem's, or {"skipped": why}."""
    why = deepspeed_aio(args.deepspeed_path)
    if why is not None:
        return {"skipped": why}
    return spawn_pair(deepspeed_worker, args)


# ---------------------------------------------------------------- report

HOST_CACHE_NOTE = (
    "note: on a virtual machine the hypervisor's host page cache may sit under the guest's\n"
    "disk: reads of data written moments ago (swap files, fresh by design) can be served from\n"
    "host memory even with O_DIRECT, so read rates here may exceed the physical disk's.")


def print_table(disk: dict, opt: dict, stage3: dict, ds: dict, args) -> None:
    gb = 1e9
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          "(other processes share this machine: expect noise)")
    mode = "O_DIRECT" if disk["raw"]["direct"] else "buffered, fdatasync (no O_DIRECT here)"
    print(f"\n1. disk under {args.nvme_path}: {args.disk_mb} MiB; raw = the best of "
          f"{', '.join(f'{t} x {m} MiB' for t, m in RAW_SHAPES)} (threads x request, all in "
          f"flight), {mode}, no fsync the swapper does not pay; swapper = {args.record_mb} MiB "
          f"records, {args.aio_threads} threads x {args.aio_block_mb} MiB blocks, "
          f"{'O_DIRECT' if disk['swap']['direct'] else 'buffered'}")
    print(f"{'':<14}{'raw GB/s':>10}{'(best shape)':>16}{'swapper GB/s':>14}{'swapper/raw':>13}")
    for op in ("write", "read"):
        raw, swap = disk["raw"][op], disk["swap"][op]
        print(f"{op:<14}{raw / gb:>10.2f}{disk['raw'][op + '_shape']:>16}{swap / gb:>14.2f}"
              f"{swap / raw:>12.0%}")
    print(HOST_CACHE_NOTE)
    threads = sorted(opt)
    print(f"\n2. CPU AdamW, {args.numel:,} fp32 parameters, sub-group {args.sub_group:,}; "
          f"Mparam/s (and % of the memory-bandwidth bound) at {' / '.join(map(str, threads))} "
          "thread(s)")
    print(f"{'kernel':<40}" + "".join(f"{f'{t} thr':>18}" for t in threads))
    for name in opt[threads[0]]:
        if name == "memcpy bytes/s":
            continue
        cells = [(opt[t][name], opt[t][name] / opt[t]["memory-bandwidth bound (28 B/param)"])
                 for t in threads]
        print(f"{name:<40}" + "".join(f"{v / 1e6:>10.1f} ({r:>4.0%})" for v, r in cells))
    print("(memcpy read+write: " + ", ".join(f"{opt[t]['memcpy bytes/s'] / gb:.2f} GB/s at {t}"
                                             for t in threads) + ")")
    print(f"\n3. stage 3 on 2 gloo ranks, GPT {args.layers} layers x {args.width} "
          f"({next(iter(stage3.values()))['psi']:,} parameters), micro-batch 4 x 128")
    base = stage3["stage 3"]["step_s"]
    print(f"{'configuration':<38}{'step ms':>10}{'vs stage 3':>12}{'read MB':>9}{'written MB':>11}"
          f"{'I/O wait ms':>12}")
    rows = dict(stage3)
    if "step_s" in ds:
        rows["DeepSpeed: nvme optimizer + params"] = ds
    for name, r in rows.items():
        io = r.get("io", {})
        cells = (f"{io['read_bytes'] / 1e6:>9.1f}{io['written_bytes'] / 1e6:>11.1f}"
                 f"{io['wait_s'] * 1e3:>12.1f}" if io else "")
        print(f"{name:<38}{r['step_s'] * 1e3:>10.1f}{r['step_s'] / base:>11.2f}x{cells}")
    for name, r in stage3.items():
        if "param_reads" in r:
            steps = args.warmup + args.steps
            print(f"{name}: {r['param_reads']} parameter shard reads from disk in {steps} steps "
                  f"for {r['units']} units ({r['param_in_memory']} found in memory): re-read "
                  "every forward and backward")
    if "skipped" in ds:
        print(f"DeepSpeed side by side skipped: {ds['skipped']}")
    else:
        print(f"DeepSpeed: offload_param.buffer_count {args.deepspeed_param_buffers} "
              "(zeromem runs with 2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--disk-mb", type=int, default=1024)
    parser.add_argument("--deepspeed-path", default=None,
                        help="a folder holding the deepspeed package (pip install --target)")
    parser.add_argument("--deepspeed-param-buffers", type=int, default=40)
    parser.add_argument("--record-mb", type=int, default=32)
    # what AsyncIO.from_config makes of DeepSpeed's default aio block (1 MiB x 8 in flight, 1 lane)
    parser.add_argument("--aio-threads", type=int, default=2)
    parser.add_argument("--aio-block-mb", type=int, default=8)
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--sub-group", type=int, default=1 << 22)
    parser.add_argument("--buffer-count", type=int, default=9)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", default=None, help="save the results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.disk_mb, args.numel, args.sub_group = 128, 1 << 20, 1 << 18
        args.steps, args.reps = 2, 1
    disk = bench_disk(args)
    opt = bench_optimizer(args, disk)
    stage3 = bench_stage3(args)
    ds = bench_deepspeed(args)
    print_table(disk, opt, stage3, ds, args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "disk": disk, "optimizer": opt,
                                              "stage3": stage3, "deepspeed": ds}, indent=2))


if __name__ == "__main__":
    main()
