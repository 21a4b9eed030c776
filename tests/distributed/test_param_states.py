"""DeepSpeed's `deepspeed.utils.safe_get_full_*` family on 2 ranks (zeromem/param_states.py).

Users log per-layer gradient norms and edit masters or optimizer states through these;
each reading is compared, on every rank, with one process that trains the same model on
the same global batch (ranks seeded differently, each with its own micro-batches):
gradients at the end of an accumulation window of 2, masters and optimizer states after
the step, at stages 0-3 (stage 3 with every parameter sharded), fp32, bf16 and fp16
(the loss scale removed), CPU offload, SGD with momentum and AdamW. Writes are checked
by what the next forward and step do.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from harness import run_distributed
from zeromem.deepspeed.utils import zero_to_fp32

SEQ, DIM = 4, 6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 3))
    net[2].bias.requires_grad_(False)  # frozen: no engine state
    return net


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    torch.manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(SEQ, DIM)


def _config(stage: int, precision: str, optimizer: str, gas: int, offload: str | None) -> dict:
    params = {"lr": 0.05, "momentum": 0.9} if optimizer == "SGD" else {"lr": 0.05,
                                                                         "weight_decay": 0.1}
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter sharded
    if offload:
        zero["offload_optimizer"] = {"device": offload}
    config = {"train_micro_batch_size_per_gpu": SEQ, "gradient_clipping": 0.0,
              "gradient_accumulation_steps": gas,
              "optimizer": {"type": optimizer, "params": params}, "zero_optimization": zero}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 10}
    return config


class Reference:
    """One process training the same model on the whole global batch."""

    def __init__(self, optimizer: str, world: int, gas: int):
        self.net = _net()
        trained = [p for p in self.net.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(trained, lr=0.05, momentum=0.9) if optimizer == "SGD" \
            else torch.optim.AdamW(trained, lr=0.05, weight_decay=0.1)
        self.world, self.gas = world, gas

    def backward(self, step: int) -> None:
        for r in range(self.world):
            for m in range(self.gas):
                loss = self.net(_batch(r, step, m)).square().mean()
                (loss / (self.world * self.gas)).backward()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def _close(got: torch.Tensor | None, want: torch.Tensor, precision: str, what: str) -> None:
    assert got is not None, what
    tol = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}[precision]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=what)


def _pieces_make_the_whole(local: torch.Tensor, whole: torch.Tensor, world: int,
                           stage: int) -> None:
    """This rank's piece and the others', in rank order, are the whole (flattened);
    at stage 0 nothing is partitioned: each rank's piece is the whole."""
    everyone: list = [None] * world
    dist.all_gather_object(everyone, local.tolist())
    if stage == 0:
        everyone = everyone[:1]
    torch.testing.assert_close(torch.tensor(sum(everyone, [])), whole.flatten().cpu(),
                               rtol=0, atol=0)


def _readings(deepspeed, rank, world, stage, precision, optimizer, gas, offload) -> None:
    """Gradients at the window's end, masters and states after the step, like one process."""
    from zeromem.deepspeed import utils
    what = f"stage {stage} {precision} {optimizer} gas {gas} offload {offload}"
    torch.manual_seed(rank)  # ranks seeded differently: the engine broadcasts rank 0's weights
    engine, *_ = deepspeed.initialize(model=_net(), config=_config(stage, precision, optimizer,
                                                                   gas, offload))
    ref = Reference(optimizer, world, gas)
    named = list(engine.module.named_parameters())
    state_key = "momentum_buffer" if optimizer == "SGD" else "exp_avg"
    for step in range(2):
        for m in range(gas):
            if m == gas - 1:  # nothing held whole before the window ends
                for _, p in named[:1]:
                    with pytest.raises(RuntimeError, match="accumulation window"):
                        utils.safe_get_full_grad(p)
            x = _batch(rank, step, m).to(engine.device, DTYPES[precision])
            engine.backward(engine(x).float().square().mean())
            if m < gas - 1:
                engine.step()
        ref.backward(step)
        for (name, p), want in zip(named, ref.net.parameters()):
            grad = utils.safe_get_full_grad(p)
            if not want.requires_grad:
                assert grad is None and utils.safe_get_full_fp32_param(p) is None, name
                continue
            _close(grad, want.grad, precision, f"{what}: grad of {name}, step {step}")
            _pieces_make_the_whole(utils.safe_get_local_grad(p), grad, world, stage)
        engine.step()
        ref.step()
        with pytest.raises(RuntimeError, match="before step"):
            utils.safe_get_full_grad(named[0][1])  # the step consumed it
        for (name, p), want in zip(named, ref.net.parameters()):
            if not want.requires_grad:
                continue
            master = utils.safe_get_full_fp32_param(p)
            _close(master, want, precision, f"{what}: master of {name}, step {step}")
            assert master.dtype == torch.float32 and master.shape == want.shape
            _pieces_make_the_whole(utils.safe_get_local_fp32_param(p), master, world, stage)
            _close(utils.safe_get_full_optimizer_state(p, state_key),
                   ref.opt.state[want][state_key], precision, f"{what}: {state_key} of {name}")
    with pytest.raises(KeyError, match=state_key):
        utils.safe_get_full_optimizer_state(named[0][1], "no_such_state")


def _writes(deepspeed, rank, world) -> None:
    """Edits through the API are what the next forward and step use: stage 3 and 2 in
    fp32, and bf16 with the optimizer on the CPU (its step reads a host copy of the
    gradient, which the edit must reach)."""
    from zeromem.deepspeed import utils
    for stage, precision, offload in ((3, "fp32", None), (2, "fp32", None), (2, "bf16", "cpu")):
        torch.manual_seed(rank)
        engine, *_ = deepspeed.initialize(model=_net(), config=_config(stage, precision, "SGD",
                                                                       1, offload))
        dtype = DTYPES[precision]
        ref = Reference("SGD", world, 1)
        refs = dict(ref.net.named_parameters())
        named = dict(engine.module.named_parameters())
        torch.manual_seed(7)  # the same new values on every rank
        new_weight = torch.randn(16, DIM)
        utils.safe_set_full_fp32_param(named["0.weight"], new_weight)
        with torch.no_grad():
            refs["0.weight"].copy_(new_weight)
        x = _batch(0, 9, 0)
        with torch.no_grad():
            _close(engine(x.to(dtype)), ref.net(x), precision,
                   f"stage {stage}: forward after setting a master")
        engine.backward(engine(_batch(rank, 0, 0).to(dtype)).float().square().mean())
        ref.backward(0)
        before = utils.safe_get_full_fp32_param(named["4.weight"])
        utils.safe_set_full_grad(named["4.weight"], torch.zeros(3, 16))  # gradient edited
        refs["4.weight"].grad.zero_()
        engine.step()
        ref.step()
        after = utils.safe_get_full_fp32_param(named["4.weight"])  # SGD's first step: lr x 0
        torch.testing.assert_close(after, before, rtol=0, atol=0, msg=f"{precision} {offload}")
        momentum = torch.full((16,), 0.25)  # an optimizer state edited
        utils.safe_set_full_optimizer_state(named["2.weight"], momentum.repeat(16, 1),
                                            "momentum_buffer")
        ref.opt.state[refs["2.weight"]]["momentum_buffer"].copy_(momentum.repeat(16, 1))
        local = utils.safe_get_local_fp32_param(named["4.bias"])
        utils.safe_set_local_fp32_param(named["4.bias"], local + 1.0)  # each rank its piece
        with torch.no_grad():
            refs["4.bias"].add_(1.0)
        engine.backward(engine(_batch(rank, 1, 0).to(dtype)).float().square().mean())
        ref.backward(1)
        engine.step()
        ref.step()
        for name, p in named.items():
            if refs[name].requires_grad:
                _close(utils.safe_get_full_fp32_param(p), refs[name], precision,
                       f"stage {stage}: master of {name} after the edits")
        with torch.no_grad():
            _close(engine(x.to(dtype)), ref.net(x), precision,
                   f"stage {stage}: forward after the edits")
        with pytest.raises(ValueError, match="values for a parameter of 96"):
            utils.safe_set_full_fp32_param(named["0.weight"], torch.zeros(5))


def _nvme_refused(deepspeed, rank, world, tmp) -> None:
    from zeromem.deepspeed import utils
    nvme = os.path.join(tmp, "nvme")
    os.makedirs(nvme, exist_ok=True)
    config = _config(3, "fp32", "SGD", 1, None)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    engine, *_ = deepspeed.initialize(model=_net(), config=config)
    engine.backward(engine(_batch(rank, 0, 0)).square().mean())
    for p in engine.module.parameters():
        with pytest.raises(NotImplementedError, match="offload_optimizer nvme"):
            utils.safe_get_full_grad(p)
        break
    engine.step()


def _zero_to_fp32(deepspeed, rank, world, tmp) -> None:
    """A stage-3 checkpoint read back whole, as DeepSpeed's zero_to_fp32 users do."""
    engine, *_ = deepspeed.initialize(model=_net(), config=_config(3, "bf16", "AdamW", 1, None))
    engine.backward(engine(_batch(rank, 0, 0).bfloat16()).float().square().mean())  # noqa: E501
    engine.step()
    ckpt = os.path.join(tmp, "ckpt")
    engine.save_checkpoint(ckpt)
    full = engine.engine.full_state_dict()  # rank 0's, from the masters
    if rank != 0:
        return
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert list(state) == list(engine.module.state_dict())
    for key, value in full.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(_net(), ckpt)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, full[key].to(value.dtype), rtol=0, atol=0, msg=key)
    out = os.path.join(tmp, "bin")
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size=400)
    with open(os.path.join(out, "pytorch_model.bin.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) == 3 and shards[0] == "pytorch_model-00001-of-00003.bin", shards
    assert sorted(os.listdir(out)) == sorted(shards + ["pytorch_model.bin.index.json"])
    merged = {}
    for name in shards:
        loaded = torch.load(os.path.join(out, name), weights_only=True)
        assert all(weight_map[key] == name for key in loaded)
        merged.update(loaded)
    assert merged.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=0, msg=key)
    out = os.path.join(tmp, "safe")
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, safe_serialization=True)
    assert os.listdir(out) == ["model.safetensors"]
    single = load_file(os.path.join(out, "model.safetensors"))
    for key, value in state.items():
        torch.testing.assert_close(single[key], value, rtol=0, atol=0, msg=key)
    trained = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        ckpt, exclude_frozen_parameters=True)
    assert list(trained) == [k for k in state if k != "2.bias"]  # the frozen bias left out


CASES = [  # stage, precision, optimizer, accumulation, offload_optimizer
    (0, "fp32", "SGD", 2, None),
    (1, "fp32", "SGD", 2, None),
    (2, "bf16", "SGD", 2, None),  # Adam turns bf16 rounding of tiny gradients into whole steps
    (2, "fp16", "SGD", 1, "cpu"),
    (3, "fp32", "SGD", 2, "cpu"),
    (3, "fp32", "AdamW", 1, None),
]


def _cases(rank: int, world: int, tmp: str) -> None:
    import zeromem.deepspeed as deepspeed
    for case in CASES:
        _readings(deepspeed, rank, world, *case)
    _writes(deepspeed, rank, world)
    _nvme_refused(deepspeed, rank, world, tmp)
    _zero_to_fp32(deepspeed, rank, world, tmp)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """Every case run in one world of 2 ranks (each rank checks its own readings);
    the stage-3 checkpoint `_zero_to_fp32` saved is left in `ckpt`."""
    tmp = tmp_path_factory.mktemp("param_states")
    run_distributed(_cases, 2, str(tmp))
    return tmp


def test_partitioned_state_of_one_parameter(world):
    assert (world / "ckpt" / "latest").is_file()


def test_the_scripts_beside_a_checkpoint_convert_it_as_deepspeeds_do(world):
    """DeepSpeed leaves zero_to_fp32.py and zero_to_torch.py in the directory saved into,
    and HF's docs run them from there; before stop 49 zeromem left neither."""
    ckpt = world / "ckpt"
    want = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    for script, dtype in (("zero_to_fp32.py", torch.float32), ("zero_to_torch.py", torch.bfloat16)):
        out = world / script
        subprocess.run([sys.executable, str(ckpt / script), ".", str(out), "--safe_serialization",
                        *(["--dtype", "bf16"] if dtype == torch.bfloat16 else [])],
                       cwd=ckpt, check=True, capture_output=True)
        got = load_file(out / "model.safetensors")
        assert got.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value.to(dtype), rtol=0, atol=0, msg=key)
    refused = subprocess.run([sys.executable, str(ckpt / "zero_to_torch.py"), ".", "out"],
                             cwd=ckpt, capture_output=True, text=True)
    assert refused.returncode == 2 and "--dtype" in refused.stderr  # required, as DeepSpeed's
