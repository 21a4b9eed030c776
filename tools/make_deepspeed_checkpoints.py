"""Make the DeepSpeed checkpoints under tests/data/deepspeed_checkpoints/ (run by hand, not in CI).

Needs DeepSpeed (a test-data tool, never a zeromem dependency); on CPU:

    python3 -m venv .venv-ds && .venv-ds/bin/pip install torch==2.13.0 deepspeed
    DS_ACCELERATOR=cpu .venv-ds/bin/python tools/make_deepspeed_checkpoints.py [CASE ...]

(CASE: a directory name below, e.g. stage2_ws2_fp16; default: every case.) With
`--universal-only` the existing checkpoints are converted again, not remade. The NVMe cases
(stage3_ws2_*_nvme*) need DeepSpeed's async_io op, which links libaio
(benchmarks/README.md says how to build it without root).

For each case (ZeRO stage, 0 to 3, world size, precision, whether `save_checkpoint` was
given `exclude_frozen_parameters=True`, which Adam, whether it carries Megatron-DeepSpeed's
client state, whether its tied embedding is frozen as a LoRA run's base is, whether the
script gave `initialize` its own optimizer and schedule instead of config blocks, whether
optimizer and parameters are offloaded to NVMe) it trains
`tests/models.py`'s TinyLM (whose `frozen` layer has requires_grad False)
with real DeepSpeed (gloo) for SAVE_AT optimizer steps on `micro_batch` data, saves a
checkpoint, trains AFTER more steps and records, in `<case>/expected.json`:

- `losses`: the loss of every micro-batch j = rank * gas + micro of every step after the save
  (G micro-batches per step at every world size, so runs of any size see the same data);
- `states`: per trained parameter, a fingerprint (sum, sum of squares, first elements) of the
  fp32 master, exp_avg and exp_avg_sq at the save, read through DeepSpeed's own API, and Adam's
  step;
- `config`: the DeepSpeed config used (gradient_accumulation_steps for one rank);
- fp16 cases: `scaler`, DeepSpeed's dynamic loss scaler at the save (`cur_scale`,
  `cur_hysteresis`, `cur_iter`, `last_overflow_iter`), and per step after it the loss
  scale it ran with (`loss_scales`), whether it was skipped on overflow (`skipped`) and
  its lr (`lrs`). The fp16 config starts at a scale high enough to overflow, with a
  short `loss_scale_window`, so that skips, hysteresis and growth all happen around
  the save.

Each ZeRO checkpoint (stages 1-3) of Adam is then converted by DeepSpeed's `ds_to_universal`,
as its users run it: the universal checkpoint lands beside it (`global_step3_universal`, `latest_universal`).
`--inject_missing_state` stands in for the `universal_checkpoint_info` that only
Megatron-DeepSpeed's models save.

DeepSpeed copies its conversion script into every checkpoint; it is removed here.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from models import PositionEmbeddingType, TinyLM, client_optimizer, micro_batch  # noqa: E402

OUT = ROOT / "tests" / "data" / "deepspeed_checkpoints"
G = 4  # micro-batches per optimizer step, whatever the world size
SAVE_AT, AFTER = 3, 3


class Case(NamedTuple):
    stage: int
    world_size: int
    precision: str
    exclude_frozen: bool = False  # save_checkpoint(exclude_frozen_parameters=True)
    # DeepSpeed's own FusedAdam (what a config without `torch_adam` gets; its param groups
    # hold keys torch's do not: bias_correction, step) instead of torch's AdamW
    fused_adam: bool = False
    client_state: bool = False  # the save carries Megatron-DeepSpeed's client state
    # HF Trainer's param groups (weights decayed, biases not), which stage 3 splits into
    # sub-groups (a large model's do at the default sub_group_size)
    two_groups: bool = False
    # DeepSpeedExamples' bf16_full.json: bf16 masters and optimizer states (DeepSpeed's PR 7700)
    bf16_masters: bool = False
    # a LoRA run's frozen base: TinyLM's embedding, which its head shares, frozen too
    frozen_tied: bool = False
    # the script's own optimizer and schedule (tests/models.py's SGD and LambdaLR), given to
    # `initialize`, as HF's Trainer gives its own when the config has no optimizer block
    client_optimizer: bool = False
    # ZeRO-Infinity: optimizer states and parameters offloaded to NVMe files while training,
    # on a TinyLM wide enough (NVME_HIDDEN) that one of its two sub-groups is swapped
    nvme: bool = False
    # ... with DeepSpeed's swap threshold lowered from 1 MiB to 4 KiB (its module constant),
    # on a TinyLM 300 wide: two of its three sub-groups swapped, in a small checkpoint
    swap_small: bool = False

    @property
    def name(self) -> str:
        flags = [flag for flag, on in (("exclude_frozen", self.exclude_frozen),
                                       ("fused_adam", self.fused_adam),
                                       ("client_state", self.client_state),
                                       ("two_groups", self.two_groups),
                                       ("bf16_masters", self.bf16_masters),
                                       ("frozen_tied", self.frozen_tied),
                                       ("client_optimizer", self.client_optimizer),
                                       ("nvme", self.nvme),
                                       ("swap_small", self.swap_small)) if on]
        return "_".join([f"stage{self.stage}_ws{self.world_size}_{self.precision}", *flags])


CASES = [
    Case(1, 1, "fp32"), Case(2, 2, "fp32"), Case(3, 2, "fp32"), Case(1, 2, "bf16"),
    Case(2, 1, "bf16"), Case(3, 2, "bf16"), Case(2, 2, "fp16"),
    Case(3, 2, "fp16", exclude_frozen=True), Case(1, 1, "fp32", exclude_frozen=True),
    Case(2, 2, "bf16", fused_adam=True), Case(3, 2, "bf16", client_state=True),
    Case(2, 2, "fp32", two_groups=True), Case(3, 2, "fp32", two_groups=True),
    Case(3, 2, "bf16", bf16_masters=True),
    Case(3, 2, "bf16", frozen_tied=True), Case(2, 2, "fp32", frozen_tied=True),
    Case(0, 2, "fp32"), Case(0, 2, "bf16"), Case(0, 2, "fp16"), Case(0, 2, "fp16", fused_adam=True),
    Case(0, 2, "fp32", client_optimizer=True), Case(2, 2, "fp32", client_optimizer=True),
    Case(3, 2, "bf16", client_optimizer=True),
    # HF's Trainer saves PEFT runs with exclude_frozen_parameters: the frozen tied embedding
    # goes, and DeepSpeed keeps its tied head's key
    Case(3, 2, "bf16", exclude_frozen=True, frozen_tied=True),
    # ZeRO-Infinity: DeepSpeed keeps a sub-group's fp32 partition and Adam states in its swap
    # files from 1 MiB a rank up, and saves them as copies of those files (offloaded_tensors/)
    Case(3, 2, "fp32", nvme=True), Case(3, 2, "bf16", nvme=True, swap_small=True),
]
# the nvme case's TinyLM hidden width and sub-groups: the first (embed, fc1, fc2.weight)
# holds 262,565 elements a rank, past DeepSpeed's 1 MiB swap threshold; the rest stays in memory
NVME_HIDDEN, NVME_SUB_GROUP = 25_000, 262_500
# swap_small: (embed, fc1.weight) and (fc1.bias, fc2.weight) hold 1,565 and 1,650 elements a
# rank, past a 4 KiB threshold; the last sub-group (60) stays in memory
SMALL_HIDDEN, SMALL_SUB_GROUP, SMALL_SWAP_BYTES = 300, 1_500, 4096
DECAY = 0.1  # the decayed group's weight decay in two_groups cases (0.01 otherwise)
FP16 = {"enabled": True, "initial_scale_power": 17, "loss_scale_window": 1, "hysteresis": 2,
        "min_loss_scale": 1}


def megatron_client_state() -> dict:
    """What Megatron-DeepSpeed passes `save_checkpoint` as client_state (megatron/checkpointing.py):
    its argparse arguments, the iteration and every generator's state (numpy's among them)."""
    args = argparse.Namespace(consumed_train_samples=48, params_dtype=torch.bfloat16,
                              position_embedding_type=PositionEmbeddingType.rotary)
    return {"args": args, "checkpoint_version": 3.0, "iteration": SAVE_AT, "tokens": 4096,
            "rng_state": [{"random_rng_state": random.getstate(),
                           "np_rng_state": numpy.random.get_state(),
                           "torch_rng_state": torch.get_rng_state()}]}


def ds_config(stage: int, world_size: int, precision: str, fused_adam: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": G // world_size,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}
                      | ({} if fused_adam else {"torch_adam": True})},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 5,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                              "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 1000,
    } | ({"fp16": FP16} if precision == "fp16" else {})


def scaler_state(engine) -> dict:
    if not hasattr(engine.optimizer, "loss_scaler"):  # stage 0: DeepSpeed's FP16_Optimizer's own
        scaler = engine.optimizer.loss_scale_config  # counts (it has no hysteresis)
        return {k: getattr(scaler, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter")}
    scaler = engine.optimizer.loss_scaler
    return {k: getattr(scaler, k) for k in ("cur_scale", "cur_hysteresis", "cur_iter",
                                            "last_overflow_iter")}


def loss_scale(engine) -> float:
    """The scale the next step runs with (1 where nothing scales: stage 0 in fp32)."""
    return float(getattr(engine.optimizer, "loss_scale", 1.0))


def fingerprint(t: torch.Tensor) -> dict:
    t = t.detach().float().flatten()
    return {"sum": t.sum().item(), "sumsq": (t * t).sum().item(), "head": t[:4].tolist()}


def train(engine, rank: int, gas: int, step: int) -> list[float]:
    losses = []
    for micro in range(gas):
        tokens, targets = micro_batch(step, rank * gas + micro, 0)
        loss = engine(tokens, targets, True)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def states(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    kinds = sorted({k for s in inner.state.values() for k, v in s.items() if k != "step"})
    out: dict = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if engine.zero_optimization_stage() == 0:
            master, state = stage0_master(engine, p)
            out[name] = {"master": fingerprint(master),
                         **{key: fingerprint(state[key]) for key in kinds}}
            continue
        out[name] = {"master": fingerprint(safe_get_full_fp32_param(p)),
                     **{key: fingerprint(full_optimizer_state(engine, p, key)) for key in kinds}}
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    assert len(steps) <= 1, steps
    if steps:  # Adam's (SGD keeps none)
        out["__step__"] = steps.pop()
    return out


def stage0_master(engine, p: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(fp32 master, optimizer state) of `p` at stage 0: in fp32 the parameter itself under
    torch's optimizer; in 16 bits DeepSpeed's FP16_Optimizer's fp32 copy of it."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "fp32_groups_flat"):  # the fused one: a flat master per group
        for low, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
            at = 0
            for lp in low:
                if lp is p:
                    state = optimizer.optimizer.state[flat]
                    return flat[at:at + p.numel()], {k: v[at:at + p.numel()]
                                                     for k, v in state.items() if k != "step"}
                at += lp.numel()
    if not hasattr(optimizer, "fp32_groups"):
        return p, optimizer.state[p]
    for low, high in zip(optimizer.fp16_groups, optimizer.fp32_groups):
        for lp, hp in zip(low, high):
            if lp is p:
                return hp, optimizer.optimizer.state[hp]
    raise KeyError("a trained parameter in no group of DeepSpeed's FP16_Optimizer")


def full_optimizer_state(engine, p: torch.Tensor, key: str) -> torch.Tensor:
    """DeepSpeed's `safe_get_full_optimizer_state`, or, where its fragment map came out empty
    (stages 1-2: a rank whose partition of a param group is padded, as HF Trainer's bias group
    is here), the same read from the optimizer's flat state directly."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_optimizer_state

    try:
        return safe_get_full_optimizer_state(p, key)
    except ValueError:
        mapping = p._hp_mapping
        full = torch.zeros(p.numel(), dtype=torch.float32)
        if mapping is not None:
            flat = engine.optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
            state = engine.optimizer.optimizer.state[flat][key]
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            full.narrow(0, lp.start, lp.numel).copy_(state.narrow(0, hp.start, hp.numel))
        dist.all_reduce(full, group=p._dp_group)
        return full.view(p.shape)


def param_groups(model: TinyLM, two_groups: bool) -> list[dict]:
    """The optimizer's param groups, by parameter name: one, or HF Trainer's two (its
    `get_decay_parameter_names`: no weight decay for biases)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not two_groups:
        return [{"params": names}]
    return [{"params": [n for n in names if not n.endswith("bias")], "weight_decay": DECAY},
            {"params": [n for n in names if n.endswith("bias")], "weight_decay": 0.0}]


def worker(rank: int, world_size: int, port: int, case: Case, out: str) -> None:
    stage, precision = case.stage, case.precision
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    config = ds_config(stage, world_size, precision, case.fused_adam)
    if case.two_groups:  # stage 3 splits each group into sub-groups of about 100 elements
        config["zero_optimization"]["sub_group_size"] = 100
    if stage == 0 and precision == "fp16":
        # DeepSpeed 0.19.8's engine scales the loss for its ZeRO optimizers only: at stage 0
        # its FP16_Optimizer divides by the scale gradients that were never scaled, so its
        # updates and Adam states shrink with the scale (DeepSpeed's open PR 8393). A static
        # scale of 1 is the one its run is right with (its curve is then a reference); the
        # fused case keeps a dynamic scale, low enough that zeromem's scaled gradients do not
        # overflow either
        config["fp16"] = {**FP16, "initial_scale_power": 4} if case.fused_adam \
            else {"enabled": True, "loss_scale": 1.0}
    if case.nvme:
        swap = {"device": "nvme", "nvme_path": tempfile.mkdtemp(prefix="ds-nvme-")}
        config["zero_optimization"].update(
            offload_optimizer=swap, offload_param=swap,
            sub_group_size=SMALL_SUB_GROUP if case.swap_small else NVME_SUB_GROUP)
    if case.swap_small:
        from deepspeed.runtime.swap_tensor import optimizer_utils
        optimizer_utils.MIN_AIO_BYTES = SMALL_SWAP_BYTES  # read when the swapper is built
        config["aio"] = {"block_size": SMALL_SWAP_BYTES}  # the threshold is the larger of both
        # a 100th of the others' rates: Adam moves all 25,000 of a logit's terms one way,
        # and at theirs the wide model's losses reach 60 after three steps
        config["optimizer"]["params"]["lr"] = 1e-4
        config["scheduler"]["params"].update(warmup_min_lr=1e-5, warmup_max_lr=1e-4)
    if case.bf16_masters:
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    torch.manual_seed(0)
    hidden = SMALL_HIDDEN if case.swap_small else NVME_HIDDEN if case.nvme else 7
    model = TinyLM(hidden=hidden)
    if case.frozen_tied:
        model.embed.requires_grad_(False)
    groups = param_groups(model, case.two_groups)
    named = dict(model.named_parameters())
    by_param = [{**g, "params": [named[n] for n in g["params"]]} for g in groups]
    if case.client_optimizer:
        del config["optimizer"], config["scheduler"]
        config["zero_allow_untested_optimizer"] = True  # SGD, at stages 1-3
        optimizer, schedule = client_optimizer(by_param)
        engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=optimizer,
                                          lr_scheduler=schedule)
    else:
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=by_param)
    gas = G // world_size
    for step in range(SAVE_AT):
        train(engine, rank, gas, step)
    engine.save_checkpoint(out, exclude_frozen_parameters=case.exclude_frozen,
                           client_state=megatron_client_state() if case.client_state else {})
    saved = states(engine)
    fp16: dict = {"loss_scales": [], "skipped": [], "lrs": []}
    if precision == "fp16":
        fp16["scaler"] = scaler_state(engine)
    curve = []
    for step in range(SAVE_AT, SAVE_AT + AFTER):
        fp16["loss_scales"].append(loss_scale(engine))
        fp16["lrs"].append(engine.get_lr()[0])
        skipped = engine.skipped_steps
        mine = torch.tensor(train(engine, rank, gas, step), dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        curve.append(torch.cat(every).tolist())  # micro-batch j = rank * gas + micro
        fp16["skipped"].append(engine.skipped_steps > skipped)
    if rank == 0:
        config["gradient_accumulation_steps"] = G
        expected = {"stage": stage, "world_size": world_size, "precision": precision,
                    "save_at": SAVE_AT, "micro_batches_per_step": G, "config": config,
                    "exclude_frozen_parameters": case.exclude_frozen,
                    # its curve after the save follows DeepSpeed's unscaled gradients (above)
                    **({"unscaled_fp16": True} if stage == 0 and case.fused_adam else {}),
                    **({"client_optimizer": True, "lrs": fp16["lrs"]} if case.client_optimizer
                       else {}),
                    **({"frozen_tied": True} if case.frozen_tied else {}),
                    **({"hidden": hidden, "lrs": fp16["lrs"]} if case.nvme else {}),
                    **({"swap_min_bytes": SMALL_SWAP_BYTES} if case.swap_small else {}),
                    **({"client_state": {"iteration": SAVE_AT, "checkpoint_version": 3.0,
                                         "tokens": 4096, "args.consumed_train_samples": 48}}
                       if case.client_state else {}),
                    **({"param_groups": groups} if case.two_groups else {}),
                    "losses": curve, "states": saved, **(fp16 if precision == "fp16" else {}),
                    "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__}
        (Path(out) / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
        for script in Path(out).glob("*.py"):  # DeepSpeed copies its converter script here
            script.unlink()
    dist.barrier()
    if case.nvme:  # each rank's own swap folder
        shutil.rmtree(config["zero_optimization"]["offload_param"]["nvme_path"])
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_universal(out: Path) -> None:
    """DeepSpeed's ds_to_universal on the checkpoint in `out`: `<tag>_universal` beside it."""
    tag = (out / "latest").read_text().strip()
    shutil.rmtree(out / f"{tag}_universal", ignore_errors=True)
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(out / tag), "--output_folder", str(out / f"{tag}_universal"),
                    "--inject_missing_state", "--num_extract_workers", "1",
                    "--num_merge_workers", "1"], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})  # client state's classes


def main() -> None:
    args = sys.argv[1:]
    universal_only = "--universal-only" in args
    wanted = set(args) - {"--universal-only"}
    known = {case.name for case in CASES}
    if wanted - known:
        sys.exit(f"unknown case(s) {sorted(wanted - known)}; known: {sorted(known)}")
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        out = OUT / case.name
        if not universal_only:
            shutil.rmtree(out, ignore_errors=True)
            mp.spawn(worker, args=(case.world_size, free_port(), case, str(out)),
                     nprocs=case.world_size)
        # ds_to_universal reads ZeRO's partitions (stage 0 has none) of Adam's states only, and
        # not those in offloaded_tensors/ (it fails on the empty ones the optimizer files hold)
        if case.stage > 0 and not case.client_optimizer and not case.nvme:
            make_universal(out)
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{out.relative_to(ROOT)}: {size / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
