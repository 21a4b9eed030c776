"""bf16 and fp16 training against fp32, and overflows across ranks (the scaler: unit/test_loss_scaler.py)."""
from __future__ import annotations

import contextlib
import copy
import tempfile

import pytest
import torch

import zeromem
from harness import run_together
from logs import ZeromemWarnings
from models import Reference, TinyLM, micro_batch, state_dict_diff, uses_sometimes


def _cfg(stage, extra):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                                  "stage3_param_persistence_threshold": 0}, **extra}


def low_precision_tracks_fp32(rank, world_size):
    """bf16 and fp16 runs stay within a stated tolerance of the fp32 reference."""
    out = {}
    for stage in (0, 1, 2, 3):
        for name, extra in (("bf16", {"bf16": {"enabled": True}}),
                            ("fp16", {"fp16": {"enabled": True, "initial_scale_power": 8}})):
            torch.manual_seed(0)
            model = TinyLM()
            ref = Reference(copy.deepcopy(model), per_rank=stage < 3)
            engine = zeromem.initialize(model, _cfg(stage, extra))
            for step in range(5):
                tokens, targets = micro_batch(step, rank, 0)
                engine.backward(engine(tokens, targets, uses_sometimes(step, rank, 0, stage < 3)))
                engine.step()
                ref.step(step, world_size, 1)
            out[(stage, name)] = (state_dict_diff(engine.full_state_dict(), ref.model),
                                  engine.skipped_steps)
    return out


def autocast_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def autocast_batch(step: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(step))  # 4 a rank


def train_autocast(model, engine, rows: slice, own_autocast: bool) -> list[torch.dtype]:
    """SGD with momentum, 4 steps; the dtype of each forward's output. `own_autocast`: the
    caller wraps the forward in torch.autocast itself (FSDP2's habit)."""
    dtypes = []
    for step in range(4):
        context = torch.autocast("cpu", dtype=torch.bfloat16) if own_autocast else \
            contextlib.nullcontext()
        with context:
            out = engine(autocast_batch(step)[rows])
        dtypes.append(out.dtype)
        engine.backward(out.float().pow(2).mean())
        engine.step()
    return dtypes


def torch_autocast_on_ranks(rank, world_size):
    """DeepSpeed's `torch_autocast` block (bfloat16, fp32 parameters), and the user's own
    autocast around a forward whose engine has none, at stages 0-3."""
    out = {}
    rows = slice(rank * 4, rank * 4 + 4)
    for stage in (0, 1, 2, 3):
        for own in (False, True):
            model = autocast_net()
            config = {"train_batch_size": 8, "zero_optimization": {
                "stage": stage, "stage3_param_persistence_threshold": 0}}
            if not own:
                config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
            engine = zeromem.initialize(model, config, optimizer=lambda g: torch.optim.SGD(
                g, lr=0.1, momentum=0.9))
            dtypes = train_autocast(model, engine, rows, own)
            with zeromem.GatheredParameters(list(model.parameters())):
                out[stage, own] = {"dtypes": [str(d) for d in dtypes],
                                   "params": [(str(p.dtype), p.detach().tolist())  # not
                                              for p in model.parameters()]}  # shared memory
    return out


@pytest.fixture(scope="module")
def world() -> dict[str, list]:
    """This file's 2-rank cases in one spawned world (spawning costs more than a case)."""
    return run_together({"tracks": (low_precision_tracks_fp32, ()),
                         "overflow": (overflow_on_one_rank, ()),
                         "autocast": (torch_autocast_on_ranks, ()),
                         "nonfinite": (nonfinite_named, ())}, 2)


def test_torch_autocast_trains_like_one_process_under_autocast(world):
    """The forward runs in bfloat16 either way (the engine's autocast, or the caller's, which
    the engine leaves alone); parameters and the update stay fp32. bf16 rounding of the
    batch sums (4 rows a rank against 8 in one process) moves the weights ~1e-4."""
    model = autocast_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    class OneProcess:
        def __call__(self, x):
            return model(x)

        def backward(self, loss):
            loss.backward()

        def step(self):
            optimizer.step()
            optimizer.zero_grad()

    train_autocast(model, OneProcess(), slice(None), own_autocast=True)
    for rank, per_rank in enumerate(world["autocast"]):
        for (stage, own), got in per_rank.items():
            assert got["dtypes"] == ["torch.bfloat16"] * 4, (rank, stage, own)
            for (dtype, g), w in zip(got["params"], model.parameters()):
                assert dtype == "torch.float32"
                torch.testing.assert_close(torch.tensor(g), w.detach(), rtol=0, atol=5e-4,
                                           msg=lambda m: f"rank {rank} stage {stage}: {m}")


def test_bf16_and_fp16_track_fp32(world):
    for per_rank in world["tracks"]:
        for (stage, name), (diff, skipped) in per_rank.items():
            # 5 AdamW steps of lr 1e-2 move weights by ~5e-2; 16-bit rounding of the weights
            # themselves is ~4e-3 (bf16) / 5e-4 (fp16) at magnitude 1.
            assert diff < (2e-2 if name == "bf16" else 5e-3), (stage, name, diff)
            assert skipped == 0


def overflow_on_one_rank(rank, world_size):
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        engine = zeromem.initialize(TinyLM(), _cfg(stage, {"fp16": {
            "enabled": True, "initial_scale_power": 8, "hysteresis": 1}}))
        before = engine.full_state_dict()
        tokens, targets = micro_batch(0, rank, 0)
        loss = engine(tokens, targets)
        if rank == 1:
            loss = loss * float("inf")  # inf gradients on rank 1 only
        engine.backward(loss)
        engine.step()
        unchanged = all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
        scale_after_overflow = engine.loss_scale
        tokens, targets = micro_batch(1, rank, 0)
        engine.backward(engine(tokens, targets))
        engine.step()
        after = engine.full_state_dict()  # {} on ranks other than 0
        changed = not all(torch.equal(before[k], v) for k, v in after.items()) if after else True
        out[stage] = (unchanged, scale_after_overflow, engine.skipped_steps, changed,
                      engine.global_steps)
    return out


def test_overflow_on_one_rank_skips_the_step_everywhere(world):
    for result in world["overflow"]:
        for stage, (unchanged, scale, skipped, changed, steps) in result.items():
            assert unchanged, f"stage {stage}: parameters moved on an overflow step"
            assert scale == 128  # 2**8 halved once (hysteresis 1)
            assert skipped == 1 and changed and steps == 2


class Poisoned(torch.nn.Module):
    """`2.bias` alone gets a NaN gradient on a rank whose `poison` is NaN."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
        self.poison = 0.0

    def forward(self, x):
        return self.net(x).mean() + self.net[2].bias.sum() * self.poison


FP16_FLOOR = {"fp16": {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1,
                       "hysteresis": 1}}
# (stage, precision and where gradients go): on NVMe at stage 3 the step begins in backward
NONFINITE = [(stage, precision) for stage in range(4) for precision in ("fp32", "fp16")] + \
    [(2, "fp32 cpu"), (3, "fp32 nvme")]


def nonfinite_config(stage: int, precision: str, path: str) -> dict:
    config = _cfg(stage, FP16_FLOOR if precision == "fp16" else {})
    place = precision.split()[1:]
    if place:
        offload = {"device": place[0], "nvme_path": path}
        config["zero_optimization"]["offload_optimizer"] = offload
        if stage == 3:
            config["zero_optimization"]["offload_param"] = dict(offload)
    return config


def nonfinite_named(rank, world_size):
    """A NaN in one parameter's gradient on rank 1: what a skipped fp32 step warns, and what
    fp16's loss-scale floor raises, on each rank (its shard of the gradient, or none)."""
    out = {}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    for stage, name in NONFINITE:
        with tempfile.TemporaryDirectory() as path:
            model = Poisoned()
            engine = zeromem.initialize(model, nonfinite_config(stage, name, path))
            model.poison = float("nan") if rank == 1 else 0.0
            try:
                with ZeromemWarnings("step skipped") as skipped:
                    engine.backward(engine(x.to(engine.compute_dtype)))
                    engine.step()
                out[stage, name] = skipped
            except RuntimeError as error:
                out[stage, name] = [str(error)]
            finally:
                engine.close()  # its swap files go before their directory
    return out


@pytest.mark.parametrize("stage,precision", NONFINITE)
def test_a_non_finite_gradient_is_named_by_parameter(world, stage, precision):
    """Each rank names the parameters whose part of its gradient shard holds inf or nan
    (the NaN is rank 1's, but reduced into every rank's sum), or says it holds none."""
    named = set()
    for rank, got in enumerate(world["nonfinite"]):
        messages = got[stage, precision]
        assert len(messages) == 1, (rank, messages)
        message = messages[0]
        if precision == "fp16":  # the floor: initial_scale_power 0
            assert "loss scale already at its minimum" in message, message
        else:
            assert "non-finite gradient norm; step skipped" in message, message
        if "'net.2.bias'" in message:
            named.add(rank)
        else:
            assert "another rank holds it" in message and "'net." not in message, (rank, message)
    # on NVMe at stage 3 the step in backward used the gradient up: nothing to read
    assert named or precision == "fp32 nvme", "no rank named net.2.bias"


def test_wall_clock_breakdown_logs_phase_times(caplog):
    torch.manual_seed(0)
    engine = zeromem.initialize(TinyLM(), {**_cfg(1, {}), "wall_clock_breakdown": True,
                                           "steps_per_print": 1})
    tokens, targets = micro_batch(0, 0, 0)
    with caplog.at_level("INFO", logger="zeromem"):
        engine.backward(engine(tokens, targets))
        engine.step()
    assert "forward" in caplog.text and "backward" in caplog.text and " ms" in caplog.text
