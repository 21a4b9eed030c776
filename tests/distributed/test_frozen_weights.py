"""Parameters frozen around `initialize`, as users freeze them: a layer unfrozen later, a
distillation teacher (or RLHF reference model) given no optimizer, LoRA's base weights at
stage 3, under torch's non-reentrant activation checkpoint too.

One world of two ranks runs every case once (tests/user_cases.py); every rank's
results are compared.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import zeromem
from harness import run_distributed
from user_cases import SGD, STAGES, WORLD, batch, build, case, config, max_diff, mlp, run_cases, \
    tokens, train_step, whole_state


def unfrozen_after_initialize(rank: int) -> dict:
    """The head trains first, then the body is unfrozen: refused at that step, naming a
    body parameter (its gradient was dropped at every step, silently)."""
    out = {}
    for stage in (0, 2, 3):
        model = build(seed=1)
        model.fc1.requires_grad_(False)
        engine = zeromem.initialize(model, config(stage, "fp32"))
        train_step(engine, 0, rank)
        model.fc1.requires_grad_(True)
        try:
            train_step(engine, 1, rank)
            out[stage] = ""
        except RuntimeError as error:
            out[stage] = str(error)
    return out


def teacher() -> nn.Module:
    """A distillation teacher (or an RLHF reference model), frozen as such scripts freeze it."""
    torch.manual_seed(9)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).requires_grad_(False)


def distillation(rank: int) -> dict:
    """A frozen teacher in an engine given no optimizer, a student trained on its outputs,
    stages 0-3 (the teacher's initialize failed with "optimizer got an empty parameter
    list" at every stage): the student's weights, and what the teacher holds at stage 3."""
    out = {}
    for stage in STAGES:
        frozen = zeromem.initialize(teacher(), {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
            "stage": stage, "stage3_param_persistence_threshold": 0}})
        student = zeromem.initialize(mlp(), {**config(stage, "fp32"), "optimizer": SGD})
        held = sum(p.numel() for p in frozen.module.parameters())
        for step in range(3):
            x = batch(step, rank)
            with torch.no_grad():
                target = frozen(x)
            student.backward((student(x) - target).pow(2).mean())
            student.step()
        out[stage] = {"student": whole_state(student), "teacher_held": held}
    return out


class LoraBlock(nn.Module):
    """A frozen base layer with a trainable low-rank adapter beside it (PEFT's LoRA)."""

    def __init__(self, dim: int = 24, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(dim, dim).requires_grad_(False)
        self.a = nn.Linear(dim, rank, bias=False)
        self.b = nn.Linear(rank, dim, bias=False)

    def forward(self, h):
        return torch.tanh(self.base(h) + self.b(self.a(h)))


class LoraModel(nn.Module):
    """A frozen embedding, LoRA blocks (under torch's non-reentrant activation checkpoint
    when `recompute`: HF's gradient_checkpointing with use_reentrant=False), a head."""

    def __init__(self, recompute: bool = False):
        super().__init__()
        self.embed = nn.Embedding(13, 24).requires_grad_(False)
        self.blocks = nn.ModuleList(LoraBlock() for _ in range(3))
        self.head = nn.Linear(24, 3)
        self.recompute = recompute

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) \
                if self.recompute else block(h)
        return self.head(h)


def lora_model(recompute: bool = False) -> nn.Module:
    torch.manual_seed(11)
    model = LoraModel(recompute)
    for block in model.blocks:
        nn.init.normal_(block.b.weight, std=0.3)  # (PEFT starts b at zero)
    return model


def lora_stage3(rank: int) -> dict:
    """LoRA at stage 3: the frozen base was kept whole on every rank (a 70B base on each
    GPU); now it is sharded like the adapters, gathered per block and released once the
    block's backward is done. Per precision (and fp32 under torch's non-reentrant
    activation checkpoint, whose recomputation, stopped early, kept every unit gathered
    to the end of backward): the trained model, what the frozen parameters hold, the
    peak gathered in backward; then a checkpoint reloaded at stages 3 and 2 by engines
    built from another seed."""
    out: dict = {}
    units = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
    for precision in ("fp32", "bf16", "recompute"):
        model = lora_model(recompute=precision == "recompute")
        cfg = {**config(3, "fp32" if precision == "recompute" else precision), "optimizer": SGD,
               "gradient_accumulation_steps": 2}
        cfg["zero_optimization"].update(units)
        engine = zeromem.initialize(model, cfg, fetch_units=(LoraBlock,))
        frozen = [p for p in model.parameters() if not p.requires_grad]
        held = {"whole": sum(p.numel() for p in frozen),
                "shards": sum(g.shard_numel for g in engine.frozen_groups)}
        peaks = []
        for step in range(3):
            for micro in range(2):
                engine.stage3.stats.peak = engine.stage3.stats.live
                engine.backward(engine(tokens(10 * step + micro)[rank * 4:rank * 4 + 4]).pow(2).mean())
                peaks.append(engine.stage3.stats.peak)
                engine.step()
        out[precision] = {"trained": whole_state(engine), "held": held, "peak": max(peaks)}
    path = [tempfile.mkdtemp() if rank == 0 else None]
    torch.distributed.broadcast_object_list(path)
    engine.save_checkpoint(path[0])
    for stage in (3, 2):
        torch.manual_seed(100 + rank)
        other = LoraModel()
        loaded = zeromem.initialize(other, {**config(stage, "fp32"), "optimizer": SGD,
                                            "gradient_accumulation_steps": 2})
        loaded.load_checkpoint(path[0])
        out["loaded", stage] = whole_state(loaded)
    out["saved"] = whole_state(engine)
    return out


class PeftBlock(nn.Module):
    """PEFT's default LoRA layout on a model loaded in bf16: the frozen base in bf16, the
    adapters upcast to fp32, the input cast to the adapters' dtype and back."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.base = nn.Linear(dim, dim).to(torch.bfloat16).requires_grad_(False)
        self.a = nn.Linear(dim, 2, bias=False)
        self.b = nn.Linear(2, dim, bias=False)
        nn.init.normal_(self.b.weight, std=0.3)

    def forward(self, h):
        out = self.base(h)
        return torch.tanh(out + self.b(self.a(h.float())).to(out.dtype))


class PeftModel(nn.Module):
    """A bf16 frozen embedding, PEFT blocks, a frozen fp32 norm (a module HF keeps in fp32)
    and a trained fp32 head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 16).to(torch.bfloat16).requires_grad_(False)
        self.blocks = nn.Sequential(PeftBlock(), PeftBlock())
        self.norm = nn.LayerNorm(16).requires_grad_(False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.norm(self.blocks(self.embed(ids)).float()))


def peft_model(seed: int = 13) -> nn.Module:
    torch.manual_seed(seed)
    return PeftModel()


def frozen_bytes(engine) -> dict[str, int]:
    """Bytes of frozen parameters this rank keeps, by dtype: whole, or stage 3's shards
    (wherever they live: in memory, or in params.swp)."""
    held: dict[str, int] = {}
    sizes = [(g.param_shard, g.shard_numel) for g in engine.frozen_groups] \
        if engine.zero_stage == 3 else \
        [(p, p.numel()) for p in engine.module.parameters() if not p.requires_grad]
    for t, numel in sizes:
        held[str(t.dtype)] = held.get(str(t.dtype), 0) + numel * t.element_size()
    return held


def peft_without_precision_block(rank: int) -> dict:
    """A PEFT model in its default layout with no precision block (HF's Trainer without
    --bf16): its bf16 base was cast to fp32, twice its memory, and its outputs and
    updates differed from one process; DeepSpeed keeps the base bf16. Stages 0-3, and 3
    with the parameters on NVMe (whose file holds shards of two dtypes): what the frozen
    parameters hold, the trained model; a stage-3 checkpoint reloaded
    by an engine built from another seed."""
    out: dict = {}
    path = tempfile.mkdtemp()
    runs = [(stage, {}) for stage in STAGES] + \
        [("nvme", {"offload_param": {"device": "nvme", "nvme_path": path}})]
    for name, offload in runs:
        cfg = {**config(3 if name == "nvme" else name, "fp32"), "optimizer": SGD}
        cfg["zero_optimization"].update(offload)
        engine = zeromem.initialize(peft_model(), cfg)
        held = frozen_bytes(engine)
        for step in range(3):
            y = engine(tokens(step)[rank * 4:rank * 4 + 4])
            engine.backward(y.float().pow(2).mean())
            engine.step()
        out[name] = {"held": held, "trained": whole_state(engine)}
    ckpt = [tempfile.mkdtemp() if rank == 0 else None]
    torch.distributed.broadcast_object_list(ckpt)
    engine.save_checkpoint(ckpt[0])
    with safe_open(next(Path(ckpt[0]).glob("*/rank00000.safetensors")), "pt") as f:
        out["saved"] = {k.removeprefix("module/"): str(f.get_tensor(k).dtype).removeprefix("torch.")
                        for k in f.keys() if k.startswith("module/")}
    loaded = zeromem.initialize(peft_model(seed=100 + rank), {**config(3, "fp32"), "optimizer": SGD})
    loaded.load_checkpoint(ckpt[0])
    out["loaded"] = {"held": frozen_bytes(loaded), "state": whole_state(loaded)}
    return out


CASES = {"unfrozen": unfrozen_after_initialize, "distillation": distillation,
         "lora": lora_stage3, "peft": peft_without_precision_block}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(run_cases, WORLD, CASES)


def test_a_parameter_unfrozen_after_initialize_is_refused_at_the_step(ranks):
    for rank, got in enumerate(case(ranks, "unfrozen")):
        for stage, error in got.items():
            assert "'fc1." in error and "frozen (requires_grad=False)" in error, (rank, stage, error)


def test_a_frozen_teacher_is_sharded_at_stage3_and_its_student_trains_as_one_process(ranks):
    model, frozen = mlp(), teacher()
    optimizer = torch.optim.SGD(model.parameters(), **SGD["params"])
    for step in range(3):
        x = torch.cat([batch(step, 0), batch(step, 1)])
        (model(x) - frozen(x)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    want = model.state_dict()
    whole = sum(p.numel() for p in frozen.parameters())
    for rank, per_rank in enumerate(case(ranks, "distillation")):
        for stage, got in per_rank.items():
            assert max_diff(got["student"], want) < 1e-6, (rank, stage)
            assert got["teacher_held"] == (0 if stage == 3 else whole), (rank, stage)


def test_lora_at_stage3_shards_the_frozen_base_and_trains_as_one_process(ranks):
    model = lora_model()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                **SGD["params"])
    for step in range(3):
        for micro in range(2):  # the global batch of a micro-step: both ranks' rows
            (model(tokens(10 * step + micro)).pow(2).mean() / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    want = model.state_dict()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    block = sum(p.numel() for p in LoraBlock().parameters())
    for rank, got in enumerate(case(ranks, "lora")):
        for precision, tol in (("fp32", 1e-6), ("bf16", 3e-2), ("recompute", 1e-6)):
            result = got[precision]
            assert max_diff(result["trained"], want) < tol, (rank, precision)
            # sharded: nothing whole outside a gather, about a half on each of 2 ranks
            assert result["held"]["whole"] == 0, (rank, precision, result["held"])
            assert frozen / 2 <= result["held"]["shards"] <= frozen / 2 + 16, result["held"]
            # a block's units (adapters and base) and the head gathered at once, at most
            assert result["peak"] <= block + 100, (rank, precision, result["peak"])
        for stage in (3, 2):  # frozen values too, whatever the loading engine's seed
            assert max_diff(got["loaded", stage], got["saved"]) == 0, (rank, stage)


def test_a_peft_model_without_a_precision_block_keeps_its_bf16_base_and_trains_as_one_process(ranks):
    model = peft_model()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                **SGD["params"])
    for step in range(3):
        model(tokens(step)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    want = {k: v.float() for k, v in model.state_dict().items()}
    bf16 = 2 * sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    fp32 = 4 * sum(p.numel() for p in model.parameters() if not p.requires_grad
                   and p.dtype == torch.float32)
    for rank, got in enumerate(case(ranks, "peft")):
        for name in (*STAGES, "nvme"):
            result = got[name]
            assert max_diff(result["trained"], want) < 1e-6, (rank, name)
            held = result["held"]
            assert set(held) == {"torch.bfloat16", "torch.float32"}, (rank, name, held)
            if name in (0, 1, 2):  # whole, in the dtypes the model was given
                assert held == {"torch.bfloat16": bf16, "torch.float32": fp32}, (rank, name)
            else:  # about a half on each of 2 ranks, in the same dtypes
                assert bf16 / 2 <= held["torch.bfloat16"] <= bf16 / 2 + 16, (rank, name, held)
                assert fp32 / 2 <= held["torch.float32"] <= fp32 / 2 + 32, (rank, name, held)
        assert max_diff(got["loaded"]["state"], got["nvme"]["trained"]) == 0, rank
        # the frozen shards written in their own dtypes (a bf16 base was written as fp32)
        assert got["saved"] == {"embed.weight": "bfloat16", "norm.weight": "float32",
                                "norm.bias": "float32",
                                **{f"blocks.{i}.base.{w}": "bfloat16" for i in (0, 1)
                                   for w in ("weight", "bias")}}, (rank, got["saved"])
        assert got["loaded"]["held"].keys() == got["nvme"]["held"].keys(), rank
