"""A plain Hugging Face Trainer run (DDP on this CPU, no DeepSpeed) that saves a checkpoint.

    torchrun --nproc_per_node 2 hf_trainer_checkpoint_script.py run OUT

Run by test_from_accelerate.py: the tiny GPT-2 of hf_setup.py, the Trainer's own AdamW
over its decay / no-decay groups (weight decay 0.1), 3 steps, `OUT/checkpoint-2` saved
after the second (model.safetensors, optimizer.pt as the optimizer's numbered
`state_dict()`, scheduler.pt, trainer_state.json, rng_state_*.pth).
"""
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_setup import BATCH, LR, Tokens, init_model_dir  # noqa: E402


def main(out: Path) -> None:
    torch.distributed.init_process_group("gloo")
    model = transformers.GPT2LMHeadModel.from_pretrained(init_model_dir(out))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=3, save_strategy="steps", save_steps=2,
        per_device_train_batch_size=BATCH, learning_rate=LR, weight_decay=0.1,
        lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to=[], seed=0,
        use_cpu=True, dataloader_drop_last=True, disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(16)).train()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[2]))
