"""A plain Accelerate loop (DDP on this CPU: no DeepSpeed, no FSDP) that saves its state.

    torchrun --nproc_per_node 2 accelerate_save_state_script.py run OUT

Run by test_from_accelerate.py. TinyLM with AdamW over Hugging Face's decay / no-decay
groups, ranks fed apart; `accelerator.save_state(OUT/state)` after SAVE_AT steps (what it
writes on this machine: model.safetensors, optimizer.bin as the optimizer's own numbered
`state_dict()`, random_states_*.pkl), then AFTER more steps. Writes OUT/losses_<rank>.json:
the losses of the steps after the save.
"""
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models import TinyLM, decay_groups, micro_batch  # noqa: E402

SAVE_AT, AFTER = 2, 2


def main(out: Path) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(decay_groups(model), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    rank = accelerator.process_index
    losses = []
    for step in range(SAVE_AT + AFTER):
        if step == SAVE_AT:
            accelerator.save_state(str(out / "state"))
        loss = model(*micro_batch(step, rank, 0))
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    (out / f"losses_{rank}.json").write_text(json.dumps(losses[SAVE_AT:]))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[2]))
