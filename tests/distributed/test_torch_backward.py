"""`loss.backward()` on what the engine's forward returned, as a DDP or FSDP2 loop writes
it (DeepSpeed 0.18+ accepts it too), trains as `engine.backward(loss)` does.

Before, zeromem refused it at `step()` ("a gradient that no engine.backward took in").
The model returns a mapping, as a Hugging Face model does: a loss computed from the
logits it also returns, and an independent auxiliary output. The loss summed over both
reaches the module through two outputs, one of them also through the other: scaling
each output's gradient (DeepSpeed's way) would scale the logits' gradient twice.

Every case: 2 gloo ranks seeded apart, each with half of every global micro-batch, SGD
with momentum and no clipping (a wrong gradient scale shows), 2 micro-steps a step, an
evaluation before the first step, compared with one process on every rank.
"""
from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeromem
from harness import run_together

WORLD = 2
MICRO = 4  # global rows per micro-step: each rank has 2
GAS = 2
STEPS = 3
DIM, CLASSES = 6, 3


class TwoOutputs(nn.Module):
    """A body, a classifier whose loss it computes, and an auxiliary head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh())
        self.head = nn.Linear(16, CLASSES)
        self.aux = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        logits = self.head(h)
        return {"loss": F.cross_entropy(logits, y), "logits": logits, "aux": self.aux(h)}


def model() -> TwoOutputs:
    torch.manual_seed(0)
    return TwoOutputs()


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(MICRO, DIM, generator=g), torch.randint(0, CLASSES, (MICRO,), generator=g)


def objective(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return out["loss"] + out["aux"].pow(2).mean()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def whole(engine) -> list[np.ndarray]:
    params = list(engine.module.parameters())
    with zeromem.GatheredParameters(params):
        return [p.detach().float().clone().numpy() for p in params]


def config(stage: int, precision: str, place: str = "") -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if place:
        zero["offload_optimizer"] = {"device": place}
    cfg = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO // WORLD,
           "zero_optimization": zero}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


CASES = [(0, "fp32", ""), (1, "fp32", ""), (2, "fp32", ""), (3, "fp32", ""), (2, "fp32", "cpu"),
         (3, "bf16", "")]


def train(engine, rows: slice, styles: tuple[str, str]) -> list[float]:
    """STEPS steps; micro-step m backpropagates as `styles[m]` says: "torch" (the caller's
    `backward()`), "scaled" (`engine.scale(loss).backward()`) or "engine"."""
    dtype = next(engine.module.parameters()).dtype
    losses = []
    with torch.no_grad():  # evaluated before the first step: no backward opens
        engine(batch(0, 0)[0][rows].to(dtype), batch(0, 0)[1][rows])
    for step in range(STEPS):
        for micro, style in enumerate(styles):
            x, y = batch(step, micro)
            loss = objective(engine(x[rows].to(dtype), y[rows]))
            if style == "torch":
                loss.backward()
            elif style == "scaled":
                engine.scale(loss).backward()
            else:
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def trained_on_ranks(rank: int, world: int) -> dict:
    rows = slice(rank * MICRO // world, (rank + 1) * MICRO // world)
    out = {}
    for stage, precision, place in CASES:
        for styles in (("torch", "torch"), ("engine", "torch")):
            torch.manual_seed(rank)
            engine = zeromem.initialize(model(), config(stage, precision, place), optimizer=sgd)
            losses = train(engine, rows, styles)
            out[stage, precision, place, styles] = {
                "weights": whole(engine), "losses": losses, "steps": engine.global_steps}
    return out


def fp16_on_ranks(rank: int, world: int) -> dict:
    """fp16: a plain `loss.backward()` is refused (its gradients would underflow without
    the loss scale); `engine.scale(loss).backward()` trains as `engine.backward(loss)`."""
    rows = slice(rank * MICRO // world, (rank + 1) * MICRO // world)
    engine = zeromem.initialize(model(), config(2, "fp16"), optimizer=sgd)
    x, y = batch(0, 0)
    try:
        objective(engine(x[rows].half(), y[rows])).backward()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    runs = {}
    for styles in (("scaled", "scaled"), ("engine", "engine")):
        engine = zeromem.initialize(model(), config(2, "fp16"), optimizer=sgd)
        train(engine, rows, styles)
        runs[styles[0]] = whole(engine)
    return {"refused": refused, **runs}


def input_gradient_on_ranks(rank: int, world: int) -> dict:
    """`torch.autograd.grad` through the outputs is no backward of the engine's: by the
    input (a gradient penalty, stage 3) or by a parameter (stage 2, where it is whole), the
    gradient is the module's, unscaled, and nothing is counted."""
    rows = slice(rank * MICRO // world, (rank + 1) * MICRO // world)
    x, y = batch(0, 0)
    x = x[rows].clone().requires_grad_()
    engine = zeromem.initialize(model(), config(3, "fp32"), optimizer=sgd)
    by_input, = torch.autograd.grad(objective(engine(x, y[rows])), x)
    backwards = engine.counters.backwards
    engine = zeromem.initialize(model(), config(2, "fp32"), optimizer=sgd)
    by_param, = torch.autograd.grad(objective(engine(x, y[rows])), engine.module.head.weight)
    return {"by_input": by_input.numpy(), "by_param": by_param.numpy(),
            "backwards": backwards + engine.counters.backwards}


class Recomputed(nn.Module):
    """Two layers recomputed in backward: by `zeromem.checkpoint`, or torch's reentrant
    checkpoint (its backward runs a backward of its own inside the caller's)."""

    def __init__(self, recompute: str):
        super().__init__()
        self.recompute = recompute
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def f(t: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(t)))
        if self.recompute == "zeromem":
            return zeromem.checkpoint(f, x)
        return torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True)


VARIANTS = {  # name: (stage, zero_optimization extras, recompute, compiled)
    "nvme, step begun in backward": (3, "nvme", "zeromem", False),
    "torch reentrant checkpoint": (2, "", "torch", False),
    "torch.compile": (3, "", "zeromem", True),
}


def variant_on_ranks(rank: int, world: int) -> dict:
    """Each variant trained twice, by `engine.backward(loss)` and by `loss.backward()`."""
    rows = slice(rank * MICRO // world, (rank + 1) * MICRO // world)
    out = {}
    for name, (stage, place, recompute, compiled) in VARIANTS.items():
        for style in ("engine", "torch"):
            with tempfile.TemporaryDirectory() as path:
                zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
                if place == "nvme":
                    zero.update({k: {"device": "nvme", "nvme_path": path}
                                 for k in ("offload_optimizer", "offload_param")})
                cfg = {"train_batch_size": MICRO * GAS,
                       "train_micro_batch_size_per_gpu": MICRO // world, "zero_optimization": zero}
                torch.manual_seed(0)
                net = nn.Sequential(nn.Linear(DIM, DIM), Recomputed(recompute), Recomputed(recompute))
                engine = zeromem.initialize(torch.compile(net) if compiled else net, cfg,
                                            optimizer=sgd)
                for step in range(STEPS):
                    for micro in range(GAS):
                        x = batch(step, micro)[0][rows].requires_grad_(recompute == "torch")
                        loss = engine(x).pow(2).mean()
                        loss.backward() if style == "torch" else engine.backward(loss)
                        engine.step()
                out[name, style] = whole(engine)
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    return run_together({"trained": (trained_on_ranks, ()), "fp16": (fp16_on_ranks, ()),
                         "input_grad": (input_gradient_on_ranks, ()),
                         "variants": (variant_on_ranks, ())}, WORLD, timeout_s=300)


def reference() -> tuple[list[np.ndarray], list[float]]:
    """One process, each micro-step's global batch whole, the loss divided by GAS."""
    module = model()
    optimizer = sgd(module.parameters())
    losses = []
    for step in range(STEPS):
        for micro in range(GAS):
            loss = objective(module(*batch(step, micro)))
            (loss / GAS).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().numpy().copy() for p in module.parameters()], losses


@pytest.mark.parametrize("styles", [("torch", "torch"), ("engine", "torch")])
@pytest.mark.parametrize("stage,precision,place", CASES)
def test_loss_backward_on_the_outputs_trains_as_one_process(runs, stage, precision, place, styles):
    want, want_losses = reference()
    tol = {"rtol": 2e-2, "atol": 2e-2} if precision == "bf16" else {"rtol": 1e-5, "atol": 1e-6}
    losses = np.mean([got[stage, precision, place, styles]["losses"] for got in runs["trained"]],
                     axis=0)  # each rank's loss is over its half: the mean is the whole's
    np.testing.assert_allclose(losses, want_losses, **tol)
    for rank, got in enumerate(runs["trained"]):
        got = got[stage, precision, place, styles]
        assert got["steps"] == STEPS, rank
        for g, w in zip(got["weights"], want):
            torch.testing.assert_close(g, w, **tol, msg=lambda m: f"rank {rank}: {m}")


def test_fp16_needs_the_loss_scale_and_engine_scale_gives_it(runs):
    for rank, got in enumerate(runs["fp16"]):
        assert "engine.scale(loss).backward()" in got["refused"], (rank, got["refused"])
        for g, w in zip(got["scaled"], got["engine"]):
            torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4, msg=lambda m: f"rank {rank}: {m}")


def test_autograd_grad_through_the_outputs_is_not_a_backward_of_the_engine(runs):
    module = model()
    x, y = batch(0, 0)
    for rank, got in enumerate(runs["input_grad"]):
        rows = slice(rank * MICRO // WORLD, (rank + 1) * MICRO // WORLD)
        xr = x[rows].clone().requires_grad_()
        by_input, by_param = torch.autograd.grad(objective(module(xr, y[rows])),
                                                 [xr, module.head.weight])
        torch.testing.assert_close(torch.from_numpy(got["by_input"]), by_input, msg=f"rank {rank}")
        torch.testing.assert_close(torch.from_numpy(got["by_param"]), by_param, msg=f"rank {rank}")
        assert got["backwards"] == 0, rank  # no backward of the engine's opened


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_backward_equals_engine_backward_bit_for_bit(runs, variant):
    """The NVMe step begun in the boundary backward, recomputation inside the backward and
    a compiled module: the caller's backward changes nothing (1/(accumulation x N_d) is a
    power of two here, so scaling gradients rather than the loss is exact)."""
    for rank, got in enumerate(runs["variants"]):
        for g, w in zip(got[variant, "torch"], got[variant, "engine"]):
            np.testing.assert_array_equal(g, w, err_msg=f"rank {rank}")
