"""Trainer parity: HF Trainer losses on zeromem against a plain DDP Trainer, step by step.

    python benchmarks/hf_trainer_parity.py [--steps 30] [--model gpt2|llama] [--out DIR]

Three torchrun worlds of 2 gloo ranks (CPU, fp32) run this file as workers: a DDP
Trainer (the reference), then the same Trainer with `install_as_deepspeed()` and HF's
own ds_config_zero2.json and ds_config_zero3.json (tests/data/hf_configs; their "auto"
values filled by HF). Same tiny model from a config (nothing downloaded), same data,
same seed. Prints, per config, the largest |loss difference| against DDP over the
steps, the step where it happens, and the losses at the first and last step.

The reference's schedule is what the configs ask for: AdamW, and WarmupLR with
`warmup_num_steps` filled from `warmup_steps=0`, which DeepSpeed (and zeromem) raise to
2 steps of log warmup: lr 0 for the first two steps, then `learning_rate`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "data" / "hf_configs"
RUNS = {"ddp": None, "zero2": "ds_config_zero2.json", "zero3": "ds_config_zero3.json"}
VOCAB, SEQ, BATCH, LR = 64, 16, 2, 1e-2
DATASET = 16  # sequences: 4 steps an epoch, so the model memorises them and the loss falls


def worker(run: str, out: Path, steps: int, model_name: str) -> None:
    """One Trainer run on this rank; rank 0 writes {step: loss} to out/<run>.json."""
    if RUNS[run] is not None:
        import zeromem.deepspeed
        zeromem.deepspeed.install_as_deepspeed()  # before transformers is imported
    import torch
    import transformers

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    init = out / f"init_{model_name}"
    if rank == 0 and not (init / "config.json").exists():
        torch.manual_seed(0)
        build_model(transformers, model_name).save_pretrained(init)
    torch.distributed.barrier()
    deepspeed = None if RUNS[run] is None else str(CONFIGS / RUNS[run])
    extra = cpu_deepspeed_state() if deepspeed else {}
    args = transformers.TrainingArguments(
        output_dir=str(out / run), per_device_train_batch_size=BATCH, max_steps=steps,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=deepspeed is None,
        dataloader_drop_last=True, deepspeed=deepspeed, disable_tqdm=True, **extra)
    model = transformers.AutoModelForCausalLM.from_pretrained(init)  # after args: zero3's Init
    optimizers = (None, None) if deepspeed else ddp_optimizers(torch, model)
    trainer = transformers.Trainer(model=model, args=args, optimizers=optimizers,
                                   train_dataset=tokens(torch, DATASET))
    trainer.train()
    if rank == 0:
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        (out / f"{run}.json").write_text(json.dumps(losses))
    torch.distributed.destroy_process_group()


def build_model(transformers, name: str):
    """A tiny causal LM with dropout off, so losses compare step by step."""
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=SEQ, vocab_size=VOCAB))


def tokens(torch, n: int):
    """n fixed random sequences; labels are the inputs."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def ddp_optimizers(torch, model) -> tuple:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(step > 1))


def cpu_deepspeed_state() -> dict:
    """Accelerate knows no DeepSpeed backend on a CPU-only machine: a gloo state, set up
    as `accelerate launch --use_deepspeed` would, and told to use it."""
    from accelerate.state import AcceleratorState, PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState(backend="gloo")
    return {"accelerator_config": {"use_configured_state": True}}


def launch(run: str, out: Path, steps: int, model_name: str) -> dict[int, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", __file__, "--worker", run, "--out", str(out),
               "--steps", str(steps), "--model", model_name]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{run} failed:\n{done.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads((out / f"{run}.json").read_text()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--out", default="/tmp/zeromem_hf_trainer_parity")
    parser.add_argument("--worker", choices=tuple(RUNS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args.worker, out, args.steps, args.model)
        return
    losses = {run: launch(run, out, args.steps, args.model) for run in RUNS}
    ddp = losses["ddp"]
    print(f"HF Trainer on zeromem vs DDP Trainer: tiny {args.model}, 2 gloo ranks, fp32, "
          f"{args.steps} steps, lr {LR}")
    print("| config | max abs loss diff | at step | loss at step 1: zeromem (DDP) | "
          f"at step {args.steps}: zeromem (DDP) |\n|---|---|---|---|---|")
    for run in ("zero2", "zero3"):
        got = losses[run]
        assert got.keys() == ddp.keys(), (run, got.keys(), ddp.keys())
        step = max(ddp, key=lambda s: abs(got[s] - ddp[s]))
        print(f"| {RUNS[run]} | {abs(got[step] - ddp[step]):.2e} | {step} | "
              f"{got[1]:.6f} ({ddp[1]:.6f}) | {got[args.steps]:.6f} ({ddp[args.steps]:.6f}) |")


if __name__ == "__main__":
    main()
