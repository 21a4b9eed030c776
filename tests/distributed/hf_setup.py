"""What every Hugging Face run of hf_trainer_script.py shares: the tiny GPT-2 (saved once,
so every run starts from the same weights), its token data, the DDP runs' optimizer, and
the CPU Accelerate state DeepSpeed runs need. Imported after `install_as_deepspeed()`
where the script installs it."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from torch.utils.data import Dataset

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 2, 6, 1e-2
RANK = int(os.environ.get("RANK", 0))


class Tokens(Dataset):
    """Fixed random token sequences; labels are the inputs (causal LM)."""

    def __init__(self, n: int, vocab: int = VOCAB):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def init_model_dir(out: Path) -> Path:
    """A tiny GPT-2 saved once (rank 0), so every run starts from the same weights."""
    path = out / "init"
    if RANK == 0 and not (path / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=SEQ,
                                         vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        transformers.GPT2LMHeadModel(config).save_pretrained(path)
    torch.distributed.barrier()
    return path


def cpu_deepspeed_state() -> dict:
    """Accelerate finds no backend for DeepSpeed on a CPU-only machine (it knows NCCL and
    friends) and would run each rank as a world of one; a state configured with gloo, as
    `accelerate launch --use_deepspeed` sets ACCELERATE_USE_DEEPSPEED, is what GPUs get."""
    from accelerate.state import AcceleratorState, PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh state per run, as
    PartialState(backend="gloo")                             # TrainingArguments does
    return {"accelerator_config": {"use_configured_state": True}}


def ddp_optimizers(model: torch.nn.Module) -> tuple:
    """What HF's ds_config files ask for: AdamW, and WarmupLR with `warmup_num_steps` filled
    from `warmup_steps=0`, which DeepSpeed (and zeromem) raise to 2 steps of log warmup:
    lr 0 for the first two steps, then `learning_rate`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(step > 1))
