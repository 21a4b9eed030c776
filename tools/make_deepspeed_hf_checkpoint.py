"""Make tests/data/deepspeed_hf_checkpoint/ (run by hand, not in CI): a tiny GPT-2 trained
by real DeepSpeed, for `zeromem consolidate --hf` from a DeepSpeed checkpoint.

Needs DeepSpeed (a test-data tool, never a zeromem dependency); on CPU, beside the dev venv:

    pip install --target /tmp/ds_pkgs --no-deps deepspeed hjson py-cpuinfo ninja msgpack einops
    DS_ACCELERATOR=cpu PYTHONPATH=/tmp/ds_pkgs .venv/bin/python tools/make_deepspeed_hf_checkpoint.py

Two gloo ranks train the model (built from a config; nothing downloaded) at ZeRO stage 3
with bf16 for 2 steps and save `ckpt/`; rank 0 writes `config/config.json` and
`expected.safetensors`: every trained parameter's full fp32 master as DeepSpeed's own API
gathers it (`safe_get_full_fp32_param`), by `named_parameters()` name (the tied lm_head
once, as `transformer.wte.weight`). DeepSpeed's copy of its conversion script is removed.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "deepspeed_hf_checkpoint"
VOCAB, SEQ, BATCH, STEPS = 64, 8, 2, 2


def config() -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0,
                                                      "torch_adam": True}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": True}, "steps_per_print": 1000}


def worker(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    import transformers
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=2, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if rank == 0:
        model.config.save_pretrained(OUT / "config")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config())
    for step in range(STEPS):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ),
                            generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(OUT / "ckpt"))
    masters = {name: safe_get_full_fp32_param(p).detach().clone().contiguous()
               for name, p in engine.module.named_parameters()}  # collective
    if rank == 0:
        save_file(masters, str(OUT / "expected.safetensors"))
        for script in (OUT / "ckpt").glob("*.py"):
            script.unlink()
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    mp.spawn(worker, args=(2, free_port()), nprocs=2)
    size = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"{OUT.relative_to(ROOT)}: {size / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
