"""The planner's host memory under CPU offload, and its communication buffers, against
resident memory (VmRSS).

Each rank (started with MALLOC_MMAP_THRESHOLD_=65536, so freed blocks go back to
the system at once) builds the model without an engine, takes VmRSS, builds the
engine, steps once and takes VmRSS again. On a CPU the "device" is host memory
too, so the difference is all the engine holds: the planner's device model states
plus host bytes, less the model's own parameters (replaced by the engine's flat
buffers). First, unmeasured engines take the process's one-time costs (gloo,
autograd threads, each dtype's kernels). Goal (issue 17): within 5 % (measured here: +0.6 % and +1.9 %;
stages 1-3 without offload +0.6 % to +1.7 %).
bf16 and fp32, planned for this machine (`predict_memory(..., device="cpu")`): in
fp32 the reduced gradient shard on a CPU "device" is the host gradient itself
(offload/masters.py `HostGrads`), held once where a GPU run holds it twice; a plan
for GPUs counts the second copy (stage 2 opt:cpu: 64.5 MB against 52.3 MB resident,
+23 %; planned for this machine 51.6 MB, -1.4 %; every setup measured within +0.8 % to
+1.9 %).
NVMe offload too: the optimizer's swap pool holds no buffer a step cannot use (no
more sub-groups in flight than the shard has, derived sub-groups of equal size), and
shard i of the parameters is always read into buffer i % buffer_count, the size of
the largest shard it serves (`ShardBuffers`), so the pages a step touches are the
pools (stage 3 opt + param:nvme measured +0.8 %; with buffers all the largest
shard's size, which the smaller shards filled in part, -6.9 %).

Communication buffers (CB) are temporary, so they are not in the footprint after a
step. The planner sizes them as the engine allocates them on gloo (the temporary
bucket, gloo's receive buffer of each reduce-scatter, chunked all-gathers), which
must equal the engine's own CB figure exactly; and they must really be resident at
once: the backward's peak (VmHWM) rises at least that far above the RSS before it
(it rises further by autograd's own gradients and, at stage 3, gathered units).
"""
from __future__ import annotations

import gc
import re

import pytest
import torch

import zeromem
from gpt import GPT, GPTConfig
from harness import run_distributed
from zeromem.planning.planner import predict_memory, shape_of

WIDE = GPTConfig(n_layer=2, n_embd=512, block_size=16)  # ~6M parameters, cheap to step
SETUPS = {"stage 2, opt:cpu": (2, "cpu", None), "stage 3, opt:cpu, param:cpu": (3, "cpu", "cpu"),
          "stage 1": (1, None, None), "stage 3": (3, None, None),
          "stage 2, opt:nvme": (2, "nvme", None),
          "stage 3, opt:nvme, param:nvme": (3, "nvme", "nvme"),
          # fp32: the host gradient is the reduced shard on this CPU "device"
          "fp32, stage 2, opt:cpu": (2, "cpu", None),
          "fp32, stage 3, opt:cpu, param:cpu": (3, "cpu", "cpu"),
          "fp32, stage 3, opt:nvme, param:nvme": (3, "nvme", "nvme")}
# unmeasured first engines, one per dtype: each dtype's first step also allocates kernel
# scratch that stays (measured: the first fp32 engine after a bf16 one +3.5 MB, the
# first bf16 one after an fp32 one +13 MB)
WARM_UP = ["stage 2, opt:cpu", "fp32, stage 2, opt:cpu"]


def _config(name: str, nvme_path: str) -> dict:
    stage, optimizer, param = SETUPS[name]
    zero: dict = {"stage": stage}
    if optimizer:
        zero["offload_optimizer"] = {"device": optimizer, "nvme_path": nvme_path}
    if param:
        zero["offload_param"] = {"device": param, "nvme_path": nvme_path}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if not name.startswith("fp32"):
        config["bf16"] = {"enabled": True}
    return config


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.MULTILINE).group(1)) * 1024


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE).group(1)) * 1024


def _reset_peak() -> int:
    """Restart the peak (VmHWM) at the resident memory now, which is returned."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss()


def _measure(rank, world_size, nvme_path):
    out = {}
    for name in WARM_UP + list(SETUPS):
        torch.manual_seed(0)
        model = GPT(WIDE)
        gc.collect()
        base = _rss()
        engine = zeromem.initialize(model, _config(name, nvme_path))
        del model
        rise = 0
        for _ in range(2):  # the first step creates the optimizer states
            tokens = torch.randint(0, 256, (1, 16))
            loss = engine(tokens, tokens)
            before = _reset_peak()
            engine.backward(loss)
            rise = _peak_rss() - before
            del loss
            engine.step()
        gc.collect()
        out[name] = (_rss() - base, rise, engine.comm.buffer_bytes_peak)
        engine.close()
        del engine
        gc.collect()
    return out


def test_engine_footprint_and_buffers_are_the_planned_bytes(monkeypatch, tmp_path):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read as each spawned rank starts
    measured = run_distributed(_measure, 2, str(tmp_path))
    with torch.device("meta"):
        shape = shape_of(GPT(WIDE))
    own = 4 * sum(shape.param_numels)  # the bare model's fp32 parameters, in the baseline
    for name in SETUPS:
        config = _config(name, str(tmp_path))
        p = predict_memory(shape, config, 2, backend="gloo", device="cpu")  # for this machine
        planned = p.model_state_bytes + p.host_bytes - own
        gpu = predict_memory(shape, config, 2, backend="gloo")  # for GPUs: a device gradient
        # held once here: the host gradient (fp32, optimizer on the host), twice on a GPU
        shared = p.host.get("host_grads", 0) if name.startswith("fp32") else 0
        assert gpu.model_state_bytes + gpu.host_bytes - own - planned == shared, name
        for rss, rise, buffers in (r[name] for r in measured):
            assert rss == pytest.approx(planned, rel=0.05), (name, rss / 1e6, planned / 1e6)
            assert buffers == p.comm_buffers, (name, buffers, p.comm)
            assert rise >= 0.95 * p.comm_buffers, (name, rise / 1e6, p.comm)
        if SETUPS[name][0] >= 2:  # a temporary bucket and gloo's receive buffer, alike
            assert set(p.comm) == {"grad_buckets", "reduce_scatter_receive"}, p.comm
            assert len(set(p.comm.values())) == 1, p.comm
