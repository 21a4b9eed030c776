"""`zeromem plan --json` and the config it recommends, run as printed (NVMe included)."""
from __future__ import annotations

import json

import torch

import zeromem
from gpt import GPT
from harness import run_distributed
from zeromem.cli import main
from zeromem.config.schema import OFFLOAD_HOST_BUDGET_BYTES

JSON_KEYS = {"name", "stage", "checkpointing", "offload_optimizer", "offload_param",
             "states_bytes", "activation_bytes", "buffer_bytes", "device_bytes",
             "host_bytes_per_node", "nvme_bytes_per_node", "step_seconds", "fits"}
# The demo GPT at micro-batch 4 x 128, fp32, on 2 ranks: GPUs of 26 MB and 95 MB of host
# memory leave only stage 3 with Pa+cpu and the optimizer on NVMe, its host budget
# (`zeromem.offload_host_budget_bytes`, written into the config) the least that keeps
# 1 MiB swap requests.
TIGHT = ["plan", "examples/gpt.py:GPT", "--gpus", "2", "--gpu-mem", "0.026GB", "--host-mem",
         "0.095GB", "--micro-batch", "4", "--seq", "128", "--dtype", "fp32", "--json"]


def _train(rank, world_size, config):
    torch.manual_seed(0)
    model = GPT()
    zeromem.checkpointing.enable(model)  # the call the plan names for its checkpointing
    engine = zeromem.initialize(model, config)
    losses = []
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        tokens = torch.randint(0, 256, (4, 32), generator=g)  # shorter than planned: faster
        loss = engine(tokens, tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    held = engine.memory_report().to_dict()["held"]
    engine.close()
    return losses, sum(b.get("nvme", 0) or 0 for b in held.values())


def test_plan_json_and_the_recommended_nvme_config_runs(tmp_path, capsys):
    assert main(TIGHT) == 2  # an NVMe setup without --nvme-path: refused, not a broken config
    assert "--nvme-path" in capsys.readouterr().err
    swap, out = tmp_path / "swap", tmp_path / "config.json"
    swap.mkdir()
    assert main(TIGHT + ["--nvme-path", str(swap), "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    names = [s["name"] for s in printed["setups"]]
    assert printed["recommended"] in names and "nvme" in printed["recommended"]
    for setup in printed["setups"]:
        assert JSON_KEYS <= set(setup)
        assert setup["offload_param"] in ("none", "cpu", "nvme")
        best, worst = setup["step_seconds"]
        assert 0 < best <= worst
        assert setup["device_bytes"] >= setup["states_bytes"] + setup["activation_bytes"]
        assert sum(setup["buffer_bytes_by_part"].values()) == setup["buffer_bytes"]
    chosen = next(s for s in printed["setups"] if s["name"] == printed["recommended"])
    assert chosen["fits"] and chosen["needs"] == "zeromem.checkpointing.enable(model)"
    assert chosen["nvme_bytes_per_node"] > 0
    config = json.loads(out.read_text())
    assert config["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(swap)
    assert 0 < config["zeromem"]["offload_host_budget_bytes"] < OFFLOAD_HOST_BUDGET_BYTES
    results = run_distributed(_train, 2, config)
    for losses, nvme in results:
        assert all(loss == loss and loss < 10 for loss in losses)  # finite: it trained
        assert nvme > 0  # the states really went to the swap directory
