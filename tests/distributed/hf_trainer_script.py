"""Hugging Face Trainer and Accelerate on zeromem, 2 ranks under torchrun (driven by
test_hf_trainer.py, which compares what each mode writes to OUT):

    torchrun --nproc-per-node 2 hf_trainer_script.py ddp OUT        # reference: plain DDP Trainer
    torchrun --nproc-per-node 2 hf_trainer_script.py zeromem OUT    # the same runs through zeromem
    torchrun --nproc-per-node 2 hf_trainer_script.py frameworks OUT # fine-tuning frameworks' configs

`zeromem` mode calls `install_as_deepspeed()` before importing transformers, then
runs HF's own ds_config_zero2.json (losses, save_model, resume_from_checkpoint)
and ds_config_zero3.json (the model loaded by `from_pretrained` under `zero.Init`;
then again with both offloads on NVMe; then `evaluate()` alone, which builds the
engine with no optimizer; then PEFT LoRA on the model loaded under Init), resumes the
Trainer checkpoints and Accelerate state real DeepSpeed saved (`deepspeed` mode, run by
hand, made them), an Accelerate loop with a DeepSpeed plugin, TRL's generation under
ZeRO-3 between training steps, and TRL's GRPOTrainer (hf_setup.py holds the model and
data every run shares; hf_accelerate_loops.py, Accelerate's own loops; hf_trl_runs.py,
TRL's). `frameworks` mode trains, through zeromem too, with each DeepSpeed config the
fine-tuning frameworks ship (tests/config_corpus.py). Rank 0 writes JSON results.

The Trainer accumulates GAS micro-batches per step, as its users mostly do: an epoch
of 16 micro-batches a rank ends in a window of one (Accelerate announces each boundary
and calls `step()` only there; the Trainer scales the short window's loss itself).
"""
from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path
from typing import Callable

MODE, OUT = sys.argv[1], Path(sys.argv[2])
if MODE in ("zeromem", "frameworks"):
    import zeromem.deepspeed

    zeromem.deepspeed.install_as_deepspeed()  # the one switch: before transformers is imported

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the corpus's helper
import config_corpus  # noqa: E402

# the model and data every run shares; Accelerate's own loops (imported after the install)
from hf_accelerate_loops import (accelerate_losses, accelerate_state_resumed,  # noqa: E402
                                 accelerate_two_models, single_process_losses)
from hf_setup import (BATCH, LR, RANK, SEQ, STEPS, VOCAB, Tokens,  # noqa: E402
                      cpu_deepspeed_state, ddp_optimizers, init_model_dir)
from hf_trl_runs import grpo, trl_generation, trl_reference  # noqa: E402

CONFIGS = Path(__file__).parent.parent / "data" / "hf_configs"
# Trainer checkpoints DeepSpeed 0.19.8 itself saved (`deepspeed_checkpoints`)
HF_DEEPSPEED = Path(__file__).parent.parent / "data" / "hf_deepspeed_checkpoints"
ADDED = 5  # tokens added to the vocabulary by resize_token_embeddings
GAS, SAMPLES = 3, 64  # 2 ranks x BATCH: 16 micro-batches a rank, 6 steps (5 x 3, then 1)
# HF's own optimizer and schedule (a config without them): warmup then linear decay, and
# weight decay, which HF's AdamW leaves off biases and LayerNorms (two param groups)
HF_SCHEDULE = {"lr_scheduler_type": "linear", "warmup_steps": 2, "weight_decay": 0.1}
# TrainingArguments(torch_compile=True): Accelerate then calls DeepSpeed's engine.compile
COMPILE = {"torch_compile": True, "torch_compile_backend": "aot_eager"}


class RaggedTokens(Tokens):
    """Tokens whose labels end in padding (-100) after 2 to 7 real tokens: the Trainer then
    averages the loss over the tokens of all ranks and micro-batches (num_items_in_batch),
    not over the batches."""

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        labels[2 + (i * 7) % (SEQ - 2):] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def training_args(name: str, deepspeed: str | None, arguments: type = transformers.TrainingArguments,
                  **extra) -> transformers.TrainingArguments:
    if deepspeed is not None:
        extra = {**cpu_deepspeed_state(), **extra}
    options = dict(output_dir=str(OUT / name), per_device_train_batch_size=BATCH,
                   max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
                   gradient_accumulation_steps=GAS, warmup_steps=0, weight_decay=0.0,
                   logging_steps=1, save_strategy="no",
                   report_to=[], seed=0, use_cpu=deepspeed is None, dataloader_drop_last=True,
                   deepspeed=deepspeed, disable_tqdm=True)
    return arguments(**{**options, **extra})


def train(name: str, deepspeed: str | None, resume: str | None = None,
          hf_optimizer: bool = False, data: Dataset | None = None,
          reference: Callable[[torch.nn.Module], tuple] | None = None, added_tokens: int = 0,
          **extra) -> dict:
    """One Trainer run: per-step losses, gradient norms and lr, parameter elements this rank
    holds after `from_pretrained`, and the trainer (for saving). `hf_optimizer`: the DDP
    Trainer builds its own optimizer and schedule, as HF does for a config without them.
    `added_tokens`: the tied embedding is resized for that many new tokens first (SFT's
    special tokens), their rows drawn around the old ones' mean (HF's `mean_resizing`)."""
    args = training_args(name, deepspeed, **extra)  # before from_pretrained: zero3 uses Init
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(OUT))
    if added_tokens:
        # ranks draw the new rows apart: rank 0's are broadcast (ZeRO-3's GatheredParameters
        # with modifier_rank 0; DDP's broadcast of the module when it wraps it)
        torch.manual_seed(1 + RANK)
        model.resize_token_embeddings(VOCAB + added_tokens, mean_resizing=True)
    held = sum(p.numel() for p in model.parameters())
    own = deepspeed is not None or hf_optimizer
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=Tokens(SAMPLES) if data is None else data,
                                   optimizers=(None, None) if own else
                                   (reference or ddp_optimizers)(model))
    trainer.train(resume_from_checkpoint=resume)
    logged = {key: {h["step"]: h[key] for h in trainer.state.log_history if key in h}
              for key in ("loss", "grad_norm", "learning_rate")}
    return {"losses": logged["loss"], "grad_norms": logged["grad_norm"],
            "lrs": logged["learning_rate"], "held": held, "trainer": trainer}


def lora(name: str, deepspeed: str | None, resume: str | None = None, **extra) -> dict:
    """PEFT LoRA on the attention's Conv1D layers with gradient checkpointing, the base model
    frozen (what most fine-tunes with ZeRO-3 run; GPT-2's tied embedding and head among
    it): losses and gradient norms, and the adapter `save_model` writes
    (OUT/<name>_adapter). `resume`: from that checkpoint of an earlier run."""
    from peft import LoraConfig, get_peft_model

    args = training_args(name, deepspeed, gradient_checkpointing=True, **extra)
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(OUT))
    model.enable_input_require_grads()
    torch.manual_seed(1)  # the adapters' A matrices: the same in both modes
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["c_attn", "c_proj"],
                                             fan_in_fan_out=True))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(SAMPLES),
                                   optimizers=(None, None) if deepspeed else ddp_optimizers(model))
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(OUT / f"{name}_adapter"))
    return {key: {h["step"]: h[key] for h in trainer.state.log_history if key in h}
            for key in ("loss", "grad_norm")}


def evaluate(name: str, deepspeed: str | None) -> float:
    """`Trainer.evaluate()` with no training before: under DeepSpeed, HF builds the engine
    with the config's optimizer and scheduler removed (ZeRO-3 inference)."""
    args = training_args(name, deepspeed, per_device_eval_batch_size=BATCH)
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(OUT))
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=Tokens(4 * BATCH),
                                   optimizers=(None, None) if deepspeed else ddp_optimizers(model))
    return trainer.evaluate()["eval_loss"]


def best_model(name: str, deepspeed: str | None) -> dict:
    """`load_best_model_at_end`: evaluated and saved every 2 steps, the Trainer reloads the
    best checkpoint when training ends (under DeepSpeed through `engine.load_checkpoint`
    on the live engine) and evaluates it again. The evaluation set is the training data, so
    its loss falls; "best" is the highest (`greater_is_better`), so that the best
    checkpoint is the first, not the weights training ended with."""
    args = training_args(name, deepspeed, eval_strategy="steps", eval_steps=2,
                         save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                         metric_for_best_model="loss", greater_is_better=True,
                         per_device_eval_batch_size=BATCH)
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(OUT))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(SAMPLES),
                                   eval_dataset=Tokens(4 * BATCH),
                                   optimizers=(None, None) if deepspeed else ddp_optimizers(model))
    trainer.train()
    return {"evaluated": {h["step"]: h["eval_loss"] for h in trainer.state.log_history
                          if "eval_loss" in h},
            "best": Path(trainer.state.best_model_checkpoint).name,
            "eval_loss": trainer.evaluate()["eval_loss"]}


class Reversed(Tokens):
    """Sequence to sequence: the target is the source reversed."""

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.ids[i].flip(0)}


def seq2seq(name: str, deepspeed: str | None) -> dict:
    """HF's translation recipe in small: a T5 (its embedding shared by encoder, decoder and
    head) trained by `Seq2SeqTrainer`, then `predict(predict_with_generate=True)`, whose
    `generate` runs the encoder on its own and then the decoder a token at a time (ranks
    stay in step: `synced_gpus` under ZeRO-3)."""
    args = training_args(name, deepspeed, transformers.Seq2SeqTrainingArguments,
                         predict_with_generate=True, generation_max_length=SEQ,
                         per_device_eval_batch_size=4)
    path = OUT / "t5_init"
    if RANK == 0 and not (path / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32,
                                       num_layers=2, num_heads=2, dropout_rate=0.0,
                                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        transformers.T5ForConditionalGeneration(config).save_pretrained(path)
    torch.distributed.barrier()
    model = transformers.T5ForConditionalGeneration.from_pretrained(path)
    trainer = transformers.Seq2SeqTrainer(
        model=model, args=args, train_dataset=Reversed(SAMPLES),
        optimizers=(None, None) if deepspeed else ddp_optimizers(model))
    trainer.train()
    predicted = trainer.predict(Reversed(8))
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "predicted": predicted.predictions.tolist(), "loss": predicted.metrics["test_loss"]}


def save(name: str, trainer: transformers.Trainer) -> None:
    """`save_model` (what users do), and the engine's own fp32 weights to compare with."""
    trainer.save_model(str(OUT / f"{name}_model"))
    trained = trainer.model_wrapped.engine.full_state_dict()  # collective; rank 0 gets it
    if RANK == 0:
        torch.save(trained, OUT / f"{name}_trained.pt")


def nvme_config(path: Path) -> str:
    """HF's config with its optimizer and parameter offload moved to NVMe (a directory
    under OUT), every other key as HF wrote it (`sub_group_size` 1e14 included)."""
    def to_nvme(config: dict) -> None:
        for key in ("offload_optimizer", "offload_param"):
            config["zero_optimization"][key] = {"device": "nvme", "nvme_path": str(OUT / "nvme")}
    if RANK == 0:
        (OUT / "nvme").mkdir(exist_ok=True)
    return edited_config(path, "nvme", to_nvme)


def schedule_free(name: str, deepspeed: str | None) -> dict:
    """`--optim schedule_free_adamw`: HF builds schedulefree's AdamW, and Accelerate calls
    its train() before training and eval() before evaluating (zeromem's optimizer had
    neither: the first step failed). Losses, and the evaluation at the average after."""
    run = train(name, deepspeed, hf_optimizer=True, optim="schedule_free_adamw",
                per_device_eval_batch_size=BATCH)
    return {"losses": run["losses"],
            "eval_loss": run["trainer"].evaluate(Tokens(4 * BATCH))["eval_loss"]}


def keeping_the_optimizer(path: Path) -> str:
    """HF's config without its optimizer and scheduler, and with
    `zero_force_ds_cpu_optimizer: false`: with the optimizer offloaded, Accelerate would
    otherwise swap whatever HF built (schedulefree's AdamW too) for DeepSpeedCPUAdam, with
    DeepSpeed as with zeromem."""
    def drop(config: dict) -> None:
        del config["optimizer"], config["scheduler"]
        config["zero_force_ds_cpu_optimizer"] = False
    return edited_config(path, "own_optimizer", drop)


def without_optimizer(path: Path) -> str:
    """HF's config without its optimizer and scheduler blocks: HF's Trainer then builds its
    own AdamW (decay and no-decay groups) and schedule before `initialize`, and Accelerate
    swaps the AdamW for DeepSpeedCPUAdam since the optimizer is offloaded."""
    def drop(config: dict) -> None:
        del config["optimizer"], config["scheduler"]
    return edited_config(path, "no_optimizer", drop)


def edited_config(path: Path, name: str, edit: Callable[[dict], None]) -> str:
    """A copy of the config at `path`, changed by `edit`, written under OUT by rank 0."""
    config = json.loads(path.read_text())
    edit(config)
    out = OUT / f"{name}_{path.name}"
    if RANK == 0:
        out.write_text(json.dumps(config))
    torch.distributed.barrier()
    return str(out)


def late_install() -> str:
    """The switch after transformers chose its DeepSpeed glue must refuse: HF would wrap
    zeromem's engine without recognising it (and save `module.` keys, loaded as random weights)."""
    import zeromem.deepspeed

    try:
        zeromem.deepspeed.install_as_deepspeed()
    except RuntimeError as error:
        return str(error)
    return ""


def deepspeed_as_hf_sees_it() -> dict:
    import importlib.metadata

    import accelerate.utils
    import deepspeed
    from transformers.integrations.deepspeed import is_deepspeed_available

    import zeromem.deepspeed
    return {"version": importlib.metadata.version("deepspeed"),
            "available": is_deepspeed_available() and accelerate.utils.is_deepspeed_available(),
            "engine": deepspeed.DeepSpeedEngine is zeromem.deepspeed.DeepSpeedEngine}


def one_group(schedule: str) -> Callable[[torch.nn.Module], tuple]:
    """The DDP reference of a config's AdamW: every parameter in one group, HF_SCHEDULE's
    weight decay on all (biases too, as DeepSpeed builds it from `model_parameters`), with
    HF's schedule ("hf") or DeepSpeed's WarmupLR over HF_SCHEDULE's 2 warmup steps ("warmup":
    lr 0 for two steps, then `learning_rate`, as `ddp_optimizers`)."""
    def build(model: torch.nn.Module) -> tuple:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR,
                                      weight_decay=HF_SCHEDULE["weight_decay"])
        if schedule == "warmup":
            return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(step > 1))
        return optimizer, transformers.get_linear_schedule_with_warmup(
            optimizer, HF_SCHEDULE["warmup_steps"], STEPS)
    return build


def framework_kind(config: dict) -> str:
    """Who builds the optimizer and schedule: HF (no optimizer block: HF's AdamW over its two
    param groups, HF's schedule), or the config's AdamW over every parameter, with HF's
    schedule (no scheduler block) or the config's WarmupLR."""
    if "optimizer" not in config:
        return "hf"
    return "config_adamw_warmup" if "scheduler" in config else "config_adamw"


def framework_configs() -> dict:
    """Each DeepSpeed config a fine-tuning framework ships (config_corpus.framework_files)
    that loads, as its users run it: the Trainer with HF_SCHEDULE's arguments, bf16 where
    the config turns it on itself (HF refuses `bf16: true` beside `--bf16` off).
    {config: its kind, losses, gradient norms, lrs}; a config equal to one run before is
    not rerun."""
    done: dict[str, dict] = {}
    results = {}
    for path in config_corpus.framework_files():
        name = str(path.relative_to(config_corpus.CORPUS))
        if name in config_corpus.FRAMEWORKS_NOT_LOADING:
            continue
        config = json.loads(path.read_text())
        text = json.dumps(config, sort_keys=True)
        if text not in done:
            # without a GPU, TrainingArguments takes bf16 only beside use_cpu
            bf16 = {"bf16": True, "use_cpu": True} \
                if config.get("bf16", {}).get("enabled") is True else {}
            run = train(f"framework_{len(done)}", str(path), **bf16, **HF_SCHEDULE)
            done[text] = {key: run[key] for key in ("losses", "grad_norms", "lrs")}
            del run
            gc.collect()
        results[name] = {"kind": framework_kind(config), **done[text]}
    return results


def deepspeed_runs() -> dict[str, str]:
    """The Trainer runs DeepSpeed itself checkpointed (mode `deepspeed`), which zeromem
    resumes: HF's ds_config_zero2.json (DeepSpeed's AdamW, offloaded, and its WarmupLR);
    ds_config_zero3.json without its optimizer block (HF's own AdamW and linear schedule,
    which DeepSpeed steps as the script's own); ds_config_zero2.json at stage 1 without its
    scheduler block or offload (DeepSpeed's AdamW under HF's schedule), and at stage 0
    (DeepSpeed's default) without either block (HF's AdamW, its two param groups numbered
    by position)."""
    def at_stage(stage: int, *blocks: str) -> Callable[[dict], None]:
        def edit(config: dict) -> None:
            for block in blocks:
                del config[block]
            del config["zero_optimization"]["offload_optimizer"]
            config["zero_optimization"]["stage"] = stage
        return edit

    zero2 = CONFIGS / "ds_config_zero2.json"
    return {"zero2": str(zero2),
            "zero3_hf_optimizer": without_optimizer(CONFIGS / "ds_config_zero3.json"),
            "zero1_hf_schedule": edited_config(zero2, "hf_schedule", at_stage(1, "scheduler")),
            "zero0_hf_optimizer": edited_config(zero2, "stage0", at_stage(0, "optimizer",
                                                                          "scheduler"))}


def deepspeed_checkpoints() -> None:
    """Mode `deepspeed`, run by hand with real DeepSpeed (a test-data tool, as
    tools/make_deepspeed_checkpoints.py):

        DS_ACCELERATOR=cpu .venv-ds/bin/torchrun --nproc-per-node 2 \\
            tests/distributed/hf_trainer_script.py deepspeed OUT

    Each of `deepspeed_runs` saves at step 3; the Trainer's checkpoint-3 (DeepSpeed's
    checkpoint with the Trainer's state, rng states and weights beside it) lands in
    tests/data/hf_deepspeed_checkpoints/<run>/, with expected.json: DeepSpeed's loss,
    gradient norm and lr at every step. An Accelerate loop's `save_state` lands in
    <that folder>/accelerate/state3, with expected.json: its losses after the save; last,
    a PEFT LoRA run at ZeRO-3 (`lora`) in <that folder>/zero3_lora."""
    import deepspeed

    accelerate = HF_DEEPSPEED / "accelerate"
    losses = accelerate_state_resumed(OUT, accelerate / "state3", save=True)
    if RANK == 0:
        for script in (accelerate / "state3").glob("*.py"):  # DeepSpeed's converters
            script.unlink()
        (accelerate / "expected.json").write_text(json.dumps(
            {"losses": losses, "deepspeed_version": deepspeed.__version__}, indent=1) + "\n")
    for name, config in deepspeed_runs().items():
        run = train(f"deepspeed_{name}", config, save_strategy="steps", save_steps=3,
                    **HF_SCHEDULE)
        if RANK == 0:
            keep_checkpoint(name, OUT / f"deepspeed_{name}" / "checkpoint-3",
                            {**{k: run[k] for k in ("losses", "grad_norms", "lrs")},
                             "deepspeed_version": deepspeed.__version__})
        torch.distributed.barrier()
    # PEFT LoRA at ZeRO-3: HF saves it with exclude_frozen_parameters (the frozen base,
    # GPT-2's tied embedding among it, left out; DeepSpeed keeps its tied head's key)
    adapted = lora("deepspeed_zero3_lora", str(CONFIGS / "ds_config_zero3.json"),
                   save_strategy="steps", save_steps=3)
    if RANK == 0:
        keep_checkpoint("zero3_lora", OUT / "deepspeed_zero3_lora" / "checkpoint-3",
                        {"losses": adapted["loss"], "grad_norms": adapted["grad_norm"],
                         "deepspeed_version": deepspeed.__version__})


def keep_checkpoint(name: str, checkpoint: Path, expected: dict) -> None:
    """`checkpoint` copied to HF_DEEPSPEED/<name>/checkpoint-3, `expected` beside it."""
    dst = HF_DEEPSPEED / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(checkpoint, dst / "checkpoint-3",
                    # DeepSpeed's converters; the arguments, pickled, which no resume reads
                    ignore=shutil.ignore_patterns("*.py", "training_args.bin"))
    (dst / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def write(name: str, data) -> None:
    if RANK == 0:
        (OUT / f"{name}.json").write_text(json.dumps(data))


def main() -> None:
    torch.distributed.init_process_group("gloo")
    if MODE == "frameworks":
        write("frameworks", framework_configs())
        return
    if MODE == "deepspeed":  # real DeepSpeed, by hand: the checkpoints zeromem resumes
        deepspeed_checkpoints()
        return
    if MODE == "ddp":
        ddp = train("ddp", None)
        own = train("ddp_hf_optimizer", None, hf_optimizer=True, **HF_SCHEDULE)
        compiled = train("ddp_compile", None, **COMPILE)
        ragged = train("ddp_ragged", None, data=RaggedTokens(SAMPLES))
        resized = train("ddp_resized", None, data=Tokens(SAMPLES, VOCAB + ADDED), added_tokens=ADDED)
        config_adamw = {kind: train(f"ddp_{kind}", None, reference=one_group(schedule),
                                    **HF_SCHEDULE)
                        for kind, schedule in (("config_adamw", "hf"),
                                               ("config_adamw_warmup", "warmup"))}
        write("ddp", {"losses": ddp["losses"], "grad_norms": ddp["grad_norms"],
                      "hf_optimizer": {k: own[k] for k in ("losses", "grad_norms", "lrs")},
                      "late_install": late_install(), "lora": lora("ddp_lora", None),
                      "compiled": compiled["losses"],
                      "ragged": {k: ragged[k] for k in ("losses", "grad_norms")},
                      "resized": {k: resized[k] for k in ("losses", "grad_norms")},
                      "grpo": grpo(OUT, "ddp_grpo", None), "seq2seq": seq2seq("ddp_seq2seq", None),
                      "eval_loss": evaluate("ddp_eval", None),
                      "schedule_free": schedule_free("ddp_schedule_free", None),
                      "best_model": best_model("ddp_best_model", None),
                      **{kind: {k: run[k] for k in ("losses", "grad_norms", "lrs")}
                         for kind, run in config_adamw.items()}})
        return
    zero2 = str(CONFIGS / "ds_config_zero2.json")
    run = train("zero2", zero2, save_strategy="steps", save_steps=3)
    save("zero2", run["trainer"])
    resumed = train("zero2", zero2, resume=str(OUT / "zero2" / "checkpoint-3"))
    # the Trainer checkpoints DeepSpeed itself saved, resumed as their users would switch
    from_deepspeed = {name: train(f"from_deepspeed_{name}", config, **HF_SCHEDULE,
                                  resume=str(HF_DEEPSPEED / name / "checkpoint-3"))
                      for name, config in deepspeed_runs().items()}
    accelerate_resumed = accelerate_state_resumed(OUT, HF_DEEPSPEED / "accelerate" / "state3",
                                                  save=False)
    lora_from_deepspeed = lora("from_deepspeed_zero3_lora", str(CONFIGS / "ds_config_zero3.json"),
                               resume=str(HF_DEEPSPEED / "zero3_lora" / "checkpoint-3"))
    zero3 = train("zero3", str(CONFIGS / "ds_config_zero3.json"))
    save("zero3", zero3["trainer"])
    zero3_nvme = train("zero3_nvme", nvme_config(CONFIGS / "ds_config_zero3.json"))
    own = train("zero3_hf_optimizer", without_optimizer(CONFIGS / "ds_config_zero3.json"),
                **HF_SCHEDULE)
    # ZeRO-3 runs before the zero2 Accelerate run: HF's global DeepSpeed config that run
    # leaves lets the single-process references build their models whole
    adapted = lora("zero3_lora", str(CONFIGS / "ds_config_zero3.json"), save_strategy="steps",
                   save_steps=3)
    adapted_resumed = lora("zero3_lora_resumed", str(CONFIGS / "ds_config_zero3.json"),
                           resume=str(OUT / "zero3_lora" / "checkpoint-3"))
    generated = trl_generation(OUT)
    compiled = train("zero3_compile", str(CONFIGS / "ds_config_zero3.json"), **COMPILE)
    ragged = train("zero3_ragged", str(CONFIGS / "ds_config_zero3.json"),
                   data=RaggedTokens(SAMPLES))
    resized = train("zero3_resized", str(CONFIGS / "ds_config_zero3.json"),
                    data=Tokens(SAMPLES, VOCAB + ADDED), added_tokens=ADDED)
    engine = compiled["trainer"].model_wrapped
    compiled_in_place = engine.is_compiled and engine.module._compiled_call_impl is not None
    grpo_steps = grpo(OUT, "zero3_grpo", str(CONFIGS / "ds_config_zero3.json"))
    two_models = accelerate_two_models(OUT)
    write("zeromem", {"deepspeed": deepspeed_as_hf_sees_it(),
                      "zero2": run["losses"], "zero2_resumed": resumed["losses"],
                      "from_deepspeed": {name: {k: r[k] for k in ("losses", "grad_norms", "lrs")}
                                         for name, r in from_deepspeed.items()},
                      "accelerate_from_deepspeed": accelerate_resumed,
                      "lora_from_deepspeed": {"losses": lora_from_deepspeed["loss"],
                                              "grad_norms": lora_from_deepspeed["grad_norm"]},
                      "zero3": zero3["losses"], "zero3_held": zero3["held"],
                      "zero3_nvme": zero3_nvme["losses"],
                      "hf_optimizer": {k: own[k] for k in ("losses", "grad_norms", "lrs")},
                      "grad_norms": {name: r["grad_norms"] for name, r in
                                     (("zero2", run), ("zero3", zero3), ("zero3_nvme", zero3_nvme))},
                      "zero3_eval_loss": evaluate("zero3_eval", str(CONFIGS / "ds_config_zero3.json")),
                      "zero2_held": run["held"], "accelerate": accelerate_losses(OUT),
                      "accelerate_two_models": two_models,
                      "lora": adapted, "lora_resumed": adapted_resumed,
                      "trl": generated, "grpo": grpo_steps,
                      "compiled": compiled["losses"], "compiled_in_place": compiled_in_place,
                      "ragged": {k: ragged[k] for k in ("losses", "grad_norms")},
                      "resized": {k: resized[k] for k in ("losses", "grad_norms")},
                      "single_process": single_process_losses(OUT),
                      "trl_reference": trl_reference(OUT),
                      "seq2seq": seq2seq("zero3_seq2seq", str(CONFIGS / "ds_config_zero3.json")),
                      "best_model": best_model("zero3_best_model", str(CONFIGS / "ds_config_zero3.json")),
                      "schedule_free": schedule_free(
                          "zero3_schedule_free", keeping_the_optimizer(CONFIGS / "ds_config_zero3.json"))})


if __name__ == "__main__":
    main()
    # as HF's examples end, and with every object that holds the group collected first:
    # destroy_process_group only drops torch's own references, and a gloo group that lives
    # on into interpreter exit sometimes aborts the process (test_hf_trainer.GLOO_EXIT_ABORT)
    gc.collect()
    torch.distributed.destroy_process_group()
