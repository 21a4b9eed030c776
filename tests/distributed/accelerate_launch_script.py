"""An Accelerate training loop with no DeepSpeed in it: the launcher's config decides.

    zeromem accelerate-launch --config_file CFG accelerate_launch_script.py zeromem OUT
    python accelerate_launch_script.py reference OUT CLIP    # one process, the same global
                                                             # batch, gradients clipped to CLIP

Run by test_accelerate_launch.py. SGD with momentum, no clipping, ranks seeded apart
before the model is built from its own seed. The launched run saves its state
(`accelerator.save_state`) after SAVE_AT steps; a fresh model then resumes from it
(`load_state`). Writes OUT/<mode>.json on rank 0: the loss of every step (the mean over
ranks), the resumed run's, and what the Accelerator ran on.
"""
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

MODE, OUT = sys.argv[1], Path(sys.argv[2])
STEPS, BATCH, RANKS = 6, 2, 2
SAVE_AT = 3  # `accelerator.save_state` after this step, then resumed from it


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(STEPS * BATCH * RANKS, 8, generator=g),
                                          torch.randn(STEPS * BATCH * RANKS, 1, generator=g))


def reference(clip: float) -> dict:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in torch.utils.data.DataLoader(data(), batch_size=BATCH * RANKS):
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses}


def prepared() -> tuple:
    """A fresh Accelerator (the launcher's config), and the model, optimizer and loader it
    prepared."""
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState(backend="gloo")  # on a CPU Accelerate finds no backend itself (GPUs: NCCL)
    accelerator = Accelerator()
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH)
    return accelerator, *accelerator.prepare(net, opt, loader)


def train(accelerator, net, opt, loader, save_at: int | None = None) -> list[float]:
    """The loop; with `save_at`, `accelerator.save_state` after that many steps."""
    losses = []
    for step, (x, y) in enumerate(loader, 1):
        loss = nn.functional.mse_loss(net(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        if step == save_at:
            accelerator.save_state(str(OUT / "state"))
    return losses


def launched() -> dict:
    torch.manual_seed(100 + int(os.environ["RANK"]))  # ranks' own seeds differ
    accelerator, net, opt, loader = prepared()
    losses = train(accelerator, net, opt, loader, save_at=SAVE_AT)
    plugin = accelerator.state.deepspeed_plugin
    # resumed as Accelerate's examples resume: a fresh model, `load_state`, the data loader
    # past the saved steps
    again, *fresh = prepared()
    again.load_state(str(OUT / "state"))
    resumed = train(again, *fresh[:2], again.skip_first_batches(fresh[2], SAVE_AT))
    # Accelerate writes DeepSpeed's gradient_clipping itself ("auto": 1.0): the reference
    # clips as the engine did
    return {"losses": losses, "engine": type(net).__module__, "clip": net.gradient_clipping(),
            "stage": plugin.zero_stage if plugin else None, "ranks": accelerator.num_processes,
            "resumed": resumed}


result = reference(float(sys.argv[3])) if MODE == "reference" else launched()
if MODE == "reference" or int(os.environ["RANK"]) == 0:
    (OUT / f"{MODE}.json").write_text(json.dumps(result))
