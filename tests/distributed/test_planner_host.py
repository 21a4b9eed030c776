"""Host and NVMe bytes the planner predicts for offload setups, against the engine's ledger.

The ledger counts the tensors the engine really holds (host masters, optimizer states,
host gradients, swap buffers, parameter shards) and the bytes of its swap files;
`predict_memory` computes them from shapes and the config (`planning/host_memory.py`).
Both come from the engine's own sizing code (`offload/sub_groups.layout_optimizer`,
`offload/budget.py`), so each named part is exact. Planned for this machine
(device="cpu"): an fp32 reduced gradient is the host gradient there, filed once on the
host (the whole gradient at stage 1). The device's model states, by category, equal the
ledger's too.
"""
from __future__ import annotations

import torch

import zeromem
from gpt import GPT, GPTConfig
from harness import run_distributed
from zeromem.config.schema import Config
from zeromem.planning.planner import layout_for, predict_memory, shape_of

SMALL = GPTConfig(n_layer=2, n_embd=128, block_size=32)
SETUPS = {"stage 2, opt:cpu": (2, "cpu", None), "stage 3, opt:cpu, param:cpu": (3, "cpu", "cpu"),
          "stage 1, opt:nvme": (1, "nvme", None), "stage 2, opt:nvme": (2, "nvme", None),
          "stage 3, opt:nvme, param:nvme": (3, "nvme", "nvme"),
          # no sub_group_size: derived from the host budget (offload/budget.py), here clamped
          # to the rank's shard
          "stage 3, opt:nvme, param:nvme, budget": (3, "nvme", "nvme"),
          # a deep thin model and a small budget: the parameter pool's share of it, not
          # psi / 8, bounds how far fetch units merge (stage3/units.py, issue 16)
          "stage 3, opt:nvme, param:nvme, budget bounds units": (3, "nvme", "nvme"),
          # the optimizer on the device: in fp32 its master was the parameter shard, which
          # leaves memory, so the engine keeps a device master (MastersOnDevice)
          "stage 3, param:cpu": (3, "none", "cpu"), "stage 3, param:nvme": (3, "none", "nvme")}
DEEP = GPTConfig(n_layer=32, n_embd=64, block_size=32)  # merged 4 blocks a unit uncapped
SMALL_BUDGET = 1 << 20  # the parameter pool's half of it caps units as 2 MiB did at a quarter
# host_memory's names -> the ledger's category of the same tensors
LEDGER = {"host_masters": "master_params", "optimizer_states": "optimizer_states",
          "host_grads": "grads", "param_shards": "params",
          "optimizer_swap_buffers": "optimizer_states", "param_swap_buffers": "params",
          "masters": "master_params", "grads": "grads"}


def _config(name: str, dtype: str, path: str) -> dict:
    stage, optimizer, param = SETUPS[name]
    zero: dict = {"stage": stage, "offload_optimizer": {"device": optimizer, "nvme_path": path}}
    if param:
        zero["offload_param"] = {"device": param, "nvme_path": path}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if "budget" not in name:
        zero["sub_group_size"] = 40_000
    if name.endswith("bounds units"):
        config["zeromem"] = {"offload_host_budget_bytes": SMALL_BUDGET}
    if dtype.startswith("bf16"):
        config["bf16"] = {"enabled": True}
    if dtype == "bf16 masters":  # no NVMe: its swap files hold fp32 masters
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return config


def _runs() -> list[tuple[str, str]]:
    """(dtype, setup): fp32 and bf16 everywhere, bf16 masters where the optimizer is not
    on NVMe."""
    return [(dtype, name) for dtype in ("fp32", "bf16", "bf16 masters") for name in SETUPS
            if dtype != "bf16 masters" or SETUPS[name][1] != "nvme"]


def _model(name: str) -> GPTConfig:
    return DEEP if name.endswith("bounds units") else SMALL


def _measure(rank, world_size, path):
    out = {}
    for dtype, name in _runs():
        torch.manual_seed(0)
        engine = zeromem.initialize(GPT(_model(name)), _config(name, dtype, path))
        out[dtype, name, "units"] = len(engine.stage3.units) if engine.stage3 else 0
        for _ in range(2):
            tokens = torch.randint(0, 256, (2, 16))
            engine.backward(engine(tokens, tokens))
            engine.step()
        out[dtype, name] = engine.memory_report().to_dict()["held"]
        engine.close()
    return out


def _by_category(parts: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part, nbytes in parts.items():
        out[LEDGER[part]] = out.get(LEDGER[part], 0.0) + nbytes
    return out


def test_host_and_nvme_bytes_equal_the_ledger(tmp_path):
    measured = run_distributed(_measure, 2, str(tmp_path))
    with torch.device("meta"):
        shapes = {model: shape_of(GPT(model)) for model in (SMALL, DEEP)}
    for (dtype, name), held in ((k, v) for k, v in measured[0].items() if len(k) == 2):
        shape = shapes[_model(name)]
        # planned for this machine: on a CPU device an fp32 reduced gradient is the host
        # gradient (the whole gradient buffer at stage 1), held once and filed on the host
        predicted = predict_memory(shape, _config(name, dtype, str(tmp_path)), 2, "gloo",
                                   device="cpu")
        if name.endswith("bounds units"):  # fewer merges than uncapped, as many as the engine
            units = measured[0][dtype, name, "units"]
            capped = shape.with_unit_caps(layout_for(Config.load(
                _config(name, dtype, str(tmp_path)), world_size=2), shape, 2).unit_caps(
                2 if dtype.startswith("bf16") else 4, 2))
            assert len(capped.unit_numels) == units > len(shape.unit_numels), (dtype, units)
        for place, parts in (("host", predicted.host), ("nvme", predicted.nvme)):
            ledger = {c: b.get(place, 0) for c, b in held.items() if b and b.get(place)}
            expected = _by_category(parts)
            assert set(expected) == set(ledger), (dtype, name, place, expected, ledger)
            for category, nbytes in expected.items():
                assert nbytes == ledger[category], (dtype, name, category)
        for category in ("params", "grads", "master_params", "optimizer_states"):
            assert predicted.device.get(category, 0) == held.get(category, {}).get("device", 0), (
                dtype, name, category)
        assert predicted.host_bytes > 0 and (predicted.nvme_bytes > 0) == ("nvme" in name)
        if SETUPS[name][1] == "cpu":  # the CPU is the device: a reduced gradient already in
            # the masters' dtype is the host gradient itself, held once
            once = dtype in ("fp32", "bf16 masters")
            assert (held["grads"].get("device", 0) == 0) == once, (dtype, name, held["grads"])
        if SETUPS[name][:2] in ((2, "nvme"), (3, "nvme")):  # reduced shards to grads.swp:
            # one gradient bucket reducing at a time (MastersOnNvme.buckets_alive: the next
            # fills meanwhile, its launch waits), so the communication buffers' peak is one
            # bucket and gloo's receive buffer
            assert predicted.comm_buffers == held["comm_buffers"]["device"], (dtype, name)
