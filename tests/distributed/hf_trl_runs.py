"""TRL's online trainers on zeromem, run by hf_trainer_script.py: its generation loop
under ZeRO-3 with a frozen reference model and the same in one process, and its
GRPOTrainer (against the DDP Trainer's)."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from hf_setup import LR, RANK, VOCAB, Tokens, cpu_deepspeed_state, ddp_optimizers, init_model_dir

TRL_STEPS, PROMPT, NEW_TOKENS = 3, 3, 4


def trl_generation(out: Path) -> list:
    """TRL's online trainers (GRPO, online DPO): each step generates with
    `unwrap_model_for_generation` (on ZeRO-3 it gathers the model whole and takes
    DeepSpeed's hooks off through its internals), then trains on what it generated, and a
    frozen reference model scores it. Rank r prompts with sequence r: (generated ids per
    rank, mean loss over the ranks, the reference model's mean loss) per step."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    from trl.models.utils import prepare_deepspeed, unwrap_model_for_generation

    cpu_deepspeed_state()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out))
    engine, optimizer = accelerator.prepare(model, DummyOptim(model.parameters()))
    # the frozen reference model of DPO / GRPO, built by TRL's own helper (its config carries
    # dotted top-level keys, which DeepSpeed ignores)
    reference = prepare_deepspeed(transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out)),
                                  accelerator)
    prompt = Tokens(2).ids[RANK:RANK + 1, :PROMPT]
    steps = []
    for _ in range(TRL_STEPS):
        with unwrap_model_for_generation(engine, accelerator) as unwrapped:
            ids = unwrapped.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=0, synced_gpus=True)
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        everyone: list = [None, None]
        torch.distributed.all_gather_object(everyone, ids.tolist())
        with torch.no_grad():
            reference_loss = reference(input_ids=ids, labels=ids).loss
        steps.append([everyone, accelerator.reduce(loss.detach(), "mean").item(),
                      accelerator.reduce(reference_loss, "mean").item()])
    return steps


GRPO_STEPS = 4


def grpo(out: Path, name: str, deepspeed: str | None) -> list[dict]:
    """TRL's GRPOTrainer as its users run it (HF's ds_config_zero3.json: both offloads, the
    reference model built by TRL under zero.Init with "auto" sizes), rewarding longer
    completions: per step its loss, gradient norm, reward and KL to the reference."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import GRPOConfig, GRPOTrainer

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t1",
                                                     pad_token="t0", eos_token="t0")
    prompts = [" ".join(f"t{int(v)}" for v in row[:PROMPT]) for row in Tokens(16).ids]
    extra = {**cpu_deepspeed_state(), "deepspeed": deepspeed} if deepspeed else {}
    args = GRPOConfig(output_dir=str(out / name), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=NEW_TOKENS, max_steps=GRPO_STEPS,
                      learning_rate=LR, beta=0.1, bf16=False, logging_steps=1, report_to=[],
                      seed=0, use_cpu=deepspeed is None, save_strategy="no", disable_tqdm=True,
                      **extra)
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out))
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                          reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                          optimizers=(None, None) if deepspeed else ddp_optimizers(model))
    trainer.train()
    return [{k: h[k] for k in ("loss", "grad_norm", "reward", "kl")}
            for h in trainer.state.log_history if "loss" in h]


def trl_reference(out: Path) -> list:
    """`trl_generation` in one process: both prompts generated, the mean loss stepped, the
    reference model's loss on what was generated."""
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out))
    reference = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    prompts = Tokens(2).ids[:, :PROMPT]
    steps = []
    for _ in range(TRL_STEPS):
        with torch.no_grad():
            ids = [model.generate(p[None], max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0) for p in prompts]
        losses = [model(input_ids=i, labels=i).loss for i in ids]
        (sum(losses) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            reference_loss = sum(reference(input_ids=i, labels=i).loss.item() for i in ids) / 2
        steps.append([[i.tolist() for i in ids], sum(v.item() for v in losses) / 2,
                      reference_loss])
    return steps
