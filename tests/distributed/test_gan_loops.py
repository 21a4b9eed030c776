"""GAN training loops: more than one backward to a step, gradients from another engine's
backward, weights edited between steps (WGAN), and a gradient penalty (WGAN-GP).

DeepSpeedExamples' GAN (training/gan/gan_deepspeed_train.py) trains two engines,
a discriminator D and a generator G, as PyTorch's DCGAN example does:

    netD.zero_grad()
    engineD.backward(errD_real); engineD.backward(errD_fake); engineD.step()
    netG.zero_grad()
    engineG.backward(errG)           # through D's module: D's parameters get gradients too
    engineG.step()

Two things in it are not one backward per micro-step of one engine:

- D takes two backwards before its step (gradient_accumulation_steps 1). Their
  gradients add up, as in PyTorch. Stages 0 and 1 reduce the whole gradient at
  the boundary backward, so the second reduction summed the first one's result
  again on every rank (N_d times it).
- G's backward runs through D's module. PyTorch puts those gradients in D's
  `param.grad`, where `netD.zero_grad()` clears them. Stages 0-2 took them into
  D's own gradient buffers instead, which `zero_grad()` on the module cannot
  reach, so D's next step included them.

Before the fix, stages 0-2 drifted from one process from the second step on (the
largest difference in D's weights was 0.27-0.83 after 4 steps, SGD with momentum);
stage 3 matched. DeepSpeed 0.19.8 runs the GAN correctly at stage 0 only: stage 1
drifts from the first step, and stages 2 and 3 assert "Gradient computed twice for
this partition".

WGAN clips the critic's weights after each step. Inside GatheredParameters(modifier_rank=0)
the clip reaches the fp32 masters at every stage (in bf16 at stages 0-2 it did not).
WGAN-GP's penalty differentiates the critic's gradient: stage 3 re-gathers each unit
for the second-order pass.

Every case runs on 2 gloo ranks seeded apart, each with half of the global batch,
against one process with the whole batch, compared on every rank.
"""
from __future__ import annotations

import contextlib
import tempfile

import numpy as np
import pytest
import torch
from torch import nn

import zeromem
from harness import run_together
from logs import ZeromemWarnings

WORLD = 2
BATCH = 8  # global: each rank has 4
STEPS = 4
NZ, NX = 4, 6


def nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(NZ, 16), nn.ReLU(), nn.Linear(16, NX), nn.Tanh())
    disc = nn.Sequential(nn.Linear(NX, 15), nn.LeakyReLU(0.2), nn.Linear(15, 1), nn.Sigmoid(),
                         nn.Flatten(0))
    return gen, disc


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, NX, generator=g), torch.randn(BATCH, NZ, generator=g)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # no clipping: a wrong scale shows


class Plain:
    """What one process does with a module and its torch optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()  # as an engine's step does


def train_gan(gen, disc, engine_g, engine_d, rows: slice,
              through_engines: bool = False) -> list[list[float]]:
    """The GAN example's loop on this rank's rows of each global batch; the losses.
    `through_engines`: the forwards call the engines rather than their modules (hooks on
    the outputs watch for a `loss.backward()` of the caller's: not what runs here)."""
    criterion = nn.BCELoss()
    losses = []
    d, g = (engine_d, engine_g) if through_engines else (disc, gen)
    for step in range(STEPS):
        real, noise = (t[rows] for t in data(step))
        disc.zero_grad()
        label = torch.ones(len(real))
        err_real = criterion(d(real), label)
        engine_d.backward(err_real)
        fake = g(noise)
        label.fill_(0)
        err_fake = criterion(d(fake.detach()), label)
        engine_d.backward(err_fake)
        engine_d.step()
        gen.zero_grad()
        label.fill_(1)
        err_gen = criterion(d(fake), label)  # D's parameters get gradients here too
        engine_g.backward(err_gen)
        engine_g.step()
        losses.append([err_real.item() + err_fake.item(), err_gen.item()])
    return losses


def whole(engine_or_module) -> list[np.ndarray]:
    """The parameters whole (gathered at stage 3), as arrays: tensors sent back from a
    spawned rank need it alive."""
    module = getattr(engine_or_module, "module", engine_or_module)
    params = list(module.parameters())
    with zeromem.GatheredParameters(params):
        return [p.detach().float().clone().numpy() for p in params]


def offload(kind: str, path: str) -> dict:
    if kind == "cpu":
        return {"offload_optimizer": {"device": "cpu"}}
    if kind == "nvme":
        return {"offload_optimizer": {"device": "nvme", "nvme_path": path},
                "offload_param": {"device": "nvme", "nvme_path": path}}
    return {}


def zero_config(stage: int, place: str, path: str) -> dict:
    """Stage `stage` with every parameter partitioned, and `place`'s offload, unclipped as the
    one-process references. NVMe begins the step in the boundary backward by default, which
    takes one backward a step: off here."""
    return {"gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  **offload(place, path)},
            **({"zeromem": {"nvme_step_in_backward": False}} if place == "nvme" else {})}


CASES = [(0, ""), (1, ""), (2, ""), (3, ""), (2, "cpu"), (3, "nvme")]


def gan_on_ranks(rank: int, world: int, through_engines: bool = False) -> dict:
    out = {}
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for stage, place in CASES:
        torch.manual_seed(rank)  # ranks seeded apart: initialize broadcasts rank 0's values
        with tempfile.TemporaryDirectory() as path:
            gen, disc = nets()
            for p in list(gen.parameters()) + list(disc.parameters()):
                p.data.add_(rank)  # rank 1 starts elsewhere: initialize must bring rank 0's
            cfg = {"train_batch_size": BATCH, **zero_config(stage, place, path)}
            engine_d = zeromem.initialize(disc, cfg, optimizer=sgd)
            engine_g = zeromem.initialize(gen, cfg, optimizer=sgd)
            with ZeromemWarnings("outside engine.backward") as warned:
                losses = torch.tensor(train_gan(gen, disc, engine_g, engine_d, rows,
                                                through_engines))
            torch.distributed.all_reduce(losses)
            out[stage, place] = {"losses": (losses / world).tolist(), "warned": warned,
                                 "gen": whole(engine_g), "disc": whole(engine_d)}
    return out


def accumulate_on_ranks(rank: int, world: int, backwards: int) -> dict:
    """One engine, gradient_accumulation_steps 2, `backwards` engine.backward calls per
    micro-step (one loss each), then engine.step()."""
    out = {}
    for stage, place in CASES:
        with tempfile.TemporaryDirectory() as path:
            model = nets()[1]
            cfg = {"train_micro_batch_size_per_gpu": BATCH // world // 2,
                   "gradient_accumulation_steps": 2, **zero_config(stage, place, path)}
            engine = zeromem.initialize(model, cfg, optimizer=sgd)
            for step in range(STEPS):
                for half in accumulate_batches(step, rank, world):
                    for part in range(backwards):
                        engine.backward(model(half).pow(part + 1).mean())
                    engine.step()
            out[stage, place] = whole(engine)
    return out


def accumulate_batches(step: int, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's rows of the step's two micro-batches (each BATCH // 2 rows globally)."""
    x = data(step)[0]
    micro = BATCH // 2
    rows = micro // world
    return [x[m * micro + rank * rows:m * micro + (rank + 1) * rows] for m in range(2)]


class Two(nn.Module):
    """Two branches: `own` makes this engine's loss, `shared` feeds another engine's."""

    def __init__(self):
        super().__init__()
        self.own = nn.Linear(NX, 5)
        self.shared = nn.Linear(NX, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(x)


def two_and_head() -> tuple[Two, nn.Linear]:
    torch.manual_seed(1)
    return Two(), nn.Linear(3, 1)


def train_left_over(two, head, engine_two, engine_head, rows: slice) -> None:
    """The head's engine backpropagates through `two.shared` (a gradient engine_two's own
    backward never brings): engine_two's next step must count it, as PyTorch's does."""
    for step in range(STEPS):
        x = data(step)[0][rows]
        engine_head.backward(head(two.shared(x)).pow(2).mean())
        engine_head.step()
        engine_two.backward(two(x).pow(2).mean())
        engine_two.step()


def left_over_on_ranks(rank: int, world: int) -> dict:
    out = {}
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for stage, place in CASES:
        with tempfile.TemporaryDirectory() as path:
            cfg = {"train_batch_size": BATCH, **zero_config(stage, place, path)}
            two, head = two_and_head()
            engine_two = zeromem.initialize(two, cfg, optimizer=sgd)
            engine_head = zeromem.initialize(head, cfg, optimizer=sgd)
            train_left_over(two, head, engine_two, engine_head, rows)
            weights = whole(engine_two)
            engine_head.backward(head(two.shared(data(0)[0][rows])).pow(2).mean())
            states = ([u.state.value for u in engine_two.stage3.units]
                      if engine_two.stage3 is not None else [])
            out[stage, place] = {"two": weights, "head": whole(engine_head), "states": states}
    return out


def refusals_on_ranks(rank: int, world: int) -> dict:
    """What `step()` says of a gradient no engine.backward took in: another engine's,
    after this engine's boundary backward; or the user's own `loss.backward()`."""
    out = {}
    x = data(0)[0][rank * BATCH // world:(rank + 1) * BATCH // world]
    for stage, place in CASES:
        with tempfile.TemporaryDirectory() as path:
            cfg = {"train_batch_size": BATCH, **zero_config(stage, place, path)}
            for case in ("after_backward", "own_loss_backward"):
                two, head = two_and_head()
                engine_two = zeromem.initialize(two, cfg, optimizer=sgd)
                engine_head = zeromem.initialize(head, cfg, optimizer=sgd)
                with ZeromemWarnings("outside engine.backward") as warned:
                    if case == "after_backward":
                        engine_two.backward(two(x).pow(2).mean())
                        engine_head.backward(head(two.shared(x)).pow(2).mean())
                    else:
                        two(x).pow(2).mean().backward()
                try:
                    engine_two.step()
                    out[stage, place, case] = "stepped"
                except RuntimeError as error:
                    out[stage, place, case] = str(error)
                out[stage, place, case, "warned"] = warned
    return out


CLIP = 0.05  # WGAN's weight clipping (Arjovsky et al.: 0.01), at a size SGD reaches here


def train_wgan_critic(critic: nn.Module, engine, rows: slice, dtype: torch.dtype,
                      edit_context) -> None:
    """A WGAN critic's loop: after each step every weight is clipped in place."""
    for step in range(STEPS):
        x = data(step)[0][rows].to(dtype)
        engine.backward(critic(x).float().mean())
        engine.step()
        with edit_context(list(critic.parameters())), torch.no_grad():
            for p in critic.parameters():
                p.clamp_(-CLIP, CLIP)


def wgan_on_ranks(rank: int, world: int) -> dict:
    """The clipping inside GatheredParameters(modifier_rank=0), at every stage: it reaches
    the fp32 masters (a plain edit of a bf16 parameter would not; at stage 3 a plain
    edit meets an empty parameter)."""
    out = {}
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for stage in range(4):
        for precision in ("fp32", "bf16"):
            critic = nets()[1]
            config = {"train_batch_size": BATCH, "bf16": {"enabled": precision == "bf16"},
                      **zero_config(stage, "", "")}
            engine = zeromem.initialize(critic, config, optimizer=sgd)
            train_wgan_critic(critic, engine, rows, engine.compute_dtype,
                              lambda params: zeromem.GatheredParameters(params, modifier_rank=0))
            out[stage, precision] = whole(engine)
    return out


def critic_gp_loss(critic: nn.Module, step: int, rows: slice) -> torch.Tensor:
    """WGAN-GP's critic loss: the gradient penalty differentiates the critic's gradient
    (autograd.grad with create_graph), so the backward runs through a backward."""
    g = torch.Generator().manual_seed(200 + step)
    real, fake, eps = (t[rows] for t in (torch.randn(BATCH, NX, generator=g),
                                         torch.randn(BATCH, NX, generator=g),
                                         torch.rand(BATCH, 1, generator=g)))
    mix = (eps * real + (1 - eps) * fake).requires_grad_(True)
    grad, = torch.autograd.grad(critic(mix).sum(), mix, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


def gp_critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(NX, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1))


def gradient_penalty_on_ranks(rank: int, world: int) -> dict:
    """Stage 3 with a fetch unit per Linear: each is re-gathered for the second-order pass."""
    out = {}
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for stage in range(4):
        critic = gp_critic()
        engine = zeromem.initialize(critic, {"train_batch_size": BATCH,
                                             **zero_config(stage, "", "")},
                                    optimizer=sgd, fetch_units=(nn.Linear,))
        for step in range(STEPS):
            engine.backward(critic_gp_loss(critic, step, rows))
            engine.step()
        out[stage] = whole(engine)
    return out


def nvme_default_refuses(rank: int, world: int) -> str:
    """With the step begun in the boundary backward (NVMe's default), a second boundary
    backward is refused, naming the key that allows it."""
    with tempfile.TemporaryDirectory() as path:
        config = {"train_batch_size": BATCH, **zero_config(3, "nvme", path)}
        del config["zeromem"]
        engine = zeromem.initialize(nets()[1], config, optimizer=sgd)
        x = data(0)[0][:BATCH // world]
        engine.backward(engine(x).mean())
        try:
            engine.backward(engine(x).mean())
        except Exception as error:  # the step begun in the first backward is not committed
            return f"{type(error).__name__}: {error}"
        return "accepted"


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    return run_together({"gan": (gan_on_ranks, ()),
                         "gan_engines": (gan_on_ranks, (True,)),
                         "twice": (accumulate_on_ranks, (2,)),
                         "left_over": (left_over_on_ranks, ()),
                         "refusals": (refusals_on_ranks, ()),
                         "wgan": (wgan_on_ranks, ()),
                         "gp": (gradient_penalty_on_ranks, ()),
                         "nvme_default": (nvme_default_refuses, ())}, WORLD, timeout_s=400)


def reference_gan() -> dict:
    gen, disc = nets()
    losses = train_gan(gen, disc, Plain(sgd(gen.parameters())), Plain(sgd(disc.parameters())),
                       slice(None))
    return {"losses": losses, "gen": whole(gen), "disc": whole(disc)}


def reference_accumulate(backwards: int) -> list[np.ndarray]:
    model = nets()[1]
    optimizer = sgd(model.parameters())
    for step in range(STEPS):
        x = data(step)[0]
        for half in (x[:BATCH // 2], x[BATCH // 2:]):
            for part in range(backwards):
                (model(half).pow(part + 1).mean() / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    return whole(model)


@pytest.mark.parametrize("through", ["modules", "engines"])
@pytest.mark.parametrize("stage,place", CASES)
def test_gan_matches_one_process_on_every_rank(runs, stage, place, through):
    """`engines`: the generator's engine.backward runs through the discriminator engine's
    outputs, whose hooks must leave it alone (not open the discriminator's backward)."""
    want = reference_gan()
    for rank, got in enumerate(runs["gan" if through == "modules" else "gan_engines"]):
        got = got[stage, place]
        np.testing.assert_allclose(got["losses"], want["losses"], atol=1e-5,
                                   err_msg=f"rank {rank}")
        # the discriminator trains first: the generator's backward through it is no misuse
        assert got["warned"] == [], (rank, got["warned"])
        for name in ("gen", "disc"):
            for g, w in zip(got[name], want[name]):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("stage,place", CASES)
def test_two_backwards_per_micro_step_match_one_process(runs, stage, place):
    want = reference_accumulate(2)
    for rank, got in enumerate(runs["twice"]):
        for g, w in zip(got[stage, place], want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: {m}")


def test_nvme_step_in_backward_refuses_a_second_boundary_backward_by_name(runs):
    for message in runs["nvme_default"]:
        assert "second boundary backward" in message and "nvme_step_in_backward" in message


@pytest.mark.parametrize("stage,place", CASES)
def test_another_engines_gradient_counts_at_the_next_step_as_in_pytorch(runs, stage, place):
    two, head = two_and_head()
    train_left_over(two, head, Plain(sgd(two.parameters())), Plain(sgd(head.parameters())),
                    slice(None))
    for rank, got in enumerate(runs["left_over"]):
        got = got[stage, place]
        for name, want in (("two", whole(two)), ("head", whole(head))):
            for g, w in zip(got[name], want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {name}: {m}")
        # what another engine's backward gathered here is released when it ends
        assert set(got["states"]) <= {"sharded"}, f"rank {rank}: {got['states']}"


@pytest.mark.parametrize("stage,place", CASES)
def test_a_gradient_no_engine_backward_took_in_is_refused_at_the_step(runs, stage, place):
    for rank, got in enumerate(runs["refusals"]):
        late = got[stage, place, "after_backward"]
        assert "'shared." in late and "no engine.backward took in" in late, (rank, late)
        own = got[stage, place, "own_loss_backward"]
        assert "'own." in own and "engine.backward(loss)" in own, (rank, own)
        assert got[stage, place, "after_backward", "warned"] == [], rank


@pytest.mark.parametrize("stage,place", CASES)
def test_a_loop_written_for_ddp_or_fsdp2_is_warned_once_at_its_first_backward(runs, stage, place):
    """`loss.backward()` before the engine ran any backward of its own (then a torch
    optimizer over model.parameters() would step each rank's own gradient): one warning
    naming a parameter, whose every gradient comes in outside the engine's backward."""
    for rank, got in enumerate(runs["refusals"]):
        warned = got[stage, place, "own_loss_backward", "warned"]
        assert len(warned) == 1 and "'own." in warned[0], (rank, warned)
        assert "engine.backward(loss)" in warned[0] and "drift apart" in warned[0], warned[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", range(4))
def test_weights_clipped_inside_gathered_parameters_reach_the_masters(runs, stage, precision):
    """bf16 at stages 0-2 lost every clip before (the next step wrote the masters over it):
    its weights ended 0.1 from one process's; bf16's own rounding moves them 4e-4."""
    critic = nets()[1]
    train_wgan_critic(critic, Plain(sgd(critic.parameters())), slice(None), torch.float32,
                      lambda params: contextlib.nullcontext())
    atol = 1e-6 if precision == "fp32" else 2e-3
    for rank, got in enumerate(runs["wgan"]):
        for g, w in zip(got[stage, precision], whole(critic)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=atol,
                                       msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.parametrize("stage", range(4))
def test_gradient_penalty_matches_one_process(runs, stage):
    critic = gp_critic()
    optimizer = sgd(critic.parameters())
    for step in range(STEPS):
        critic_gp_loss(critic, step, slice(None)).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank, got in enumerate(runs["gp"]):
        for g, w in zip(got[stage], whole(critic)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: {m}")
