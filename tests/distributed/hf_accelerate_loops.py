"""Accelerate's own training loops on zeromem, run by hf_trainer_script.py's zeromem mode: a
loop with a DeepSpeed plugin and its one-process reference, and Accelerate's multiple-model
API (a dict of DeepSpeed plugins)."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from hf_setup import BATCH, LR, STEPS, Tokens, cpu_deepspeed_state, init_model_dir


ACCELERATE_GAS = 2


def accelerate_losses(out: Path) -> list[float]:
    """A plain Accelerate loop with a DeepSpeed plugin (stage 2, optimizer from the config)
    accumulating ACCELERATE_GAS micro-batches under `accelerator.accumulate`: one mean
    loss over the ranks per micro-batch."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    cpu_deepspeed_state()
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0,
              "gradient_accumulation_steps": ACCELERATE_GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 2}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out))
    samples = 2 * ACCELERATE_GAS * BATCH * STEPS
    loader = torch.utils.data.DataLoader(Tokens(samples), batch_size=BATCH)
    engine, optimizer, loader = accelerator.prepare(model, DummyOptim(model.parameters()),
                                                    loader)
    losses = []
    for batch in loader:
        with accelerator.accumulate(engine):
            loss = engine(**batch).loss
            accelerator.backward(loss)
            optimizer.step()  # Accelerate's: the engine stepped in backward at the boundary
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    keys = list(accelerator.get_state_dict(engine))
    assert accelerator.unwrap_model(engine) is model and keys and \
        not any(k.startswith("module.") for k in keys), keys
    assert engine.global_steps == STEPS, engine.global_steps
    return losses


def accelerate_state_resumed(out: Path, state: Path, save: bool) -> list[float]:
    """Accelerate's `save_state` / `load_state` under a DeepSpeed plugin (stage 2, the
    script's own AdamW and linear schedule, ACCELERATE_GAS micro-batches a step): with
    `save`, the loop saves its state at `state` after 3 steps and runs on; without, it
    loads that state and runs the same micro-batches after it. This rank's mean loss over
    the ranks of each micro-batch after the save."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    cpu_deepspeed_state()
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0,
              "gradient_accumulation_steps": ACCELERATE_GAS, "zero_optimization": {"stage": 2}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, 2, 10)
    loader = torch.utils.data.DataLoader(Tokens(2 * ACCELERATE_GAS * BATCH * 6), batch_size=BATCH)
    engine, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    saved_at = 3 * ACCELERATE_GAS  # micro-batches a rank runs before the save
    if not save:
        accelerator.load_state(str(state))
    losses = []
    for i, batch in enumerate(loader):
        if i < saved_at and not save:
            continue
        with accelerator.accumulate(engine):
            loss = engine(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        if i >= saved_at:
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
        if save and i == saved_at - 1:
            accelerator.save_state(str(state))
    return losses


MULTI_MODEL = (Path(__file__).parent.parent / "data" / "ds_config_corpus" / "accelerate" / "tests"
               / "deepspeed")


class Scaled(torch.nn.Module):
    """A frozen one-parameter model in the loss (Accelerate's multiple-model test's
    NoiseModel); its `config` gives Accelerate the hidden size its "auto" values need."""

    def __init__(self):
        super().__init__()
        self.factor = torch.nn.Parameter(torch.tensor(0.1))
        self.config = transformers.PretrainedConfig(hidden_size=16)

    def forward(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.factor


def accelerate_two_models(out: Path) -> dict:
    """Accelerate's multiple-model API as its test_ds_multiple_model.py runs it: a dict of
    DeepSpeed plugins from its ds_config_zero{2,3}_model_only.json (the optimizer offloaded,
    at ZeRO-3 the parameters too), a student trained under the first beside a frozen model
    prepared under the second, then two models trained side by side, one per plugin, each
    with its own optimizer and schedule. Per-step mean losses over the ranks."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    def plugins() -> tuple:
        zero2, zero3 = (DeepSpeedPlugin(hf_ds_config=str(MULTI_MODEL / f"ds_config_zero{n}_model_only.json"))
                        for n in (2, 3))
        # the file's train_batch_size 1 fails DeepSpeed's batch assertion on 2 ranks
        zero3.deepspeed_config.update(train_batch_size=2 * BATCH, train_micro_batch_size_per_gpu=BATCH)
        return zero2, zero3

    def trained(accelerator, loader=None) -> tuple:
        model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        schedule = transformers.get_linear_schedule_with_warmup(optimizer, 0, STEPS)
        if loader is None:
            return accelerator.prepare(model, optimizer, schedule)
        return accelerator.prepare(loader, model, optimizer, schedule)

    def mean(accelerator, loss: torch.Tensor) -> float:
        return accelerator.reduce(loss.detach(), "mean").item()

    curves: dict = {"student": [], "frozen_term": [], "zero2": [], "zero3": []}
    cpu_deepspeed_state()
    zero2, zero3 = plugins()
    accelerator = Accelerator(deepspeed_plugins={"training": zero2, "inference": zero3})
    loader = torch.utils.data.DataLoader(Tokens(2 * BATCH * STEPS), batch_size=BATCH)
    loader, student, optimizer, schedule = trained(accelerator, loader)
    accelerator.state.select_deepspeed_plugin("inference")
    frozen = accelerator.prepare(Scaled())
    frozen.eval()
    accelerator.state.select_deepspeed_plugin("training")
    for batch in loader:
        with accelerator.accumulate(student):
            loss = student(**batch).loss
            with torch.no_grad():
                term = frozen(loss)
            accelerator.backward(loss + term)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        curves["student"].append(mean(accelerator, loss))
        curves["frozen_term"].append(mean(accelerator, term / loss))
    AcceleratorState._reset_state(True)
    cpu_deepspeed_state()
    zero2, zero3 = plugins()
    first = Accelerator(deepspeed_plugins={"zero2": zero2, "zero3": zero3})
    second = Accelerator()  # the same state: selects the second plugin
    loader = torch.utils.data.DataLoader(Tokens(2 * BATCH * STEPS), batch_size=BATCH)
    loader, model2, optimizer2, schedule2 = trained(first, loader)
    second.state.select_deepspeed_plugin("zero3")
    model3, optimizer3, schedule3 = trained(second)
    for batch in loader:
        with first.accumulate(model2, model3):
            for name, accelerator, model, optimizer, schedule in (
                    ("zero2", first, model2, optimizer2, schedule2),
                    ("zero3", second, model3, optimizer3, schedule3)):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
                curves[name].append(mean(accelerator, loss))
    return curves


def single_process_losses(out: Path) -> list[float]:
    """The Accelerate loop's reference: one process, a step on the 2 x ACCELERATE_GAS
    micro-batches the ranks ran (rank r's micro-step k is batch 2k + r), each micro-step's
    loss the mean of its two batches'."""
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ids, losses = Tokens(2 * ACCELERATE_GAS * BATCH * STEPS).ids, []
    batches = ids.split(BATCH)
    per_step = 2 * ACCELERATE_GAS
    for step in range(STEPS):
        window = [model(input_ids=b, labels=b).loss
                  for b in batches[per_step * step: per_step * (step + 1)]]
        (sum(window) / per_step).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses += [(a.item() + b.item()) / 2 for a, b in zip(window[::2], window[1::2])]
    return losses
