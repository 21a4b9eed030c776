"""Setups real users have that once gave wrong results (issue 10, items 1, 3, 4 and 7).

- ranks seeded differently: `initialize` broadcasts rank 0's parameters and buffers;
- evaluation before the first step, on every rank;
- stage 3 holds only shards right after `initialize` (bytes of live storages);
- weights loaded into `engine.module` take effect, at every stage and precision;
- bf16/fp16 masters start from the user's fp32 values, not their rounding.

Spawning costs seconds, so one world of two ranks runs every case once (a
module-scoped fixture); each test reads the results it needs. Every rank reports
what it sees, and the tests compare all ranks, not rank 0 only.
"""
from __future__ import annotations

import contextlib
import tempfile
import traceback

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import zeromem
import zeromem.deepspeed as zeromem_deepspeed
from harness import run_distributed
from zeromem.param_states import MASTER
from models import TinyLM, micro_batch

WORLD = 2
STAGES = (0, 1, 2, 3)
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}


class Net(nn.Module):
    """Odd sizes (padding), a BatchNorm (buffers), no tied weights."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 9)
        self.norm = nn.BatchNorm1d(9)
        self.fc2 = nn.Linear(9, 3)

    def forward(self, x):                         # x: (B, 6)
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))  # (B, 3)


def build(seed: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():  # running statistics that differ with the seed as well
        net.norm.running_mean.uniform_(-1, 1)
        net.norm.running_var.uniform_(0.5, 2.0)
    return net


def config(stage: int, precision: str, lr: float = 1e-2) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, **PRECISIONS[precision],
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def train_step(engine, step: int, rank: int) -> None:
    x = batch(step, rank).to(engine.compute_dtype)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()


def whole_state(engine) -> dict[str, torch.Tensor]:
    """This rank's module state in fp32: parameters whole (gathered at stage 3), buffers."""
    gathered = zeromem.GatheredParameters(list(engine.module.parameters())) \
        if engine.zero_stage == 3 else contextlib.nullcontext()
    with gathered:
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


# ---------------------------------------------------------------- cases (run on every rank)

def seeded_differently(rank: int) -> dict:
    """Ranks build from different seeds; init state, eval output and trained params per rank."""
    out = {}
    for stage in STAGES:
        for precision in ("fp32", "bf16"):
            engine = zeromem.initialize(build(seed=1 + rank), config(stage, precision))
            init = whole_state(engine)
            engine.module.eval()  # evaluation before the first step
            with torch.no_grad():
                evaluated = engine(batch(99, 0).to(engine.compute_dtype)).float()
            engine.module.train()
            for step in range(3):
                train_step(engine, step, rank)
            out[stage, precision] = {"init": init, "eval": evaluated, "trained": whole_state(engine)}
    return out


def storages_after_initialize(rank: int) -> dict:
    """Stage 3: elements of the live storages the module's parameters and the engine reach."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 5))
    numel = sum(p.numel() for p in model.parameters())
    engine = zeromem.initialize(model, config(3, "bf16"))

    def elements(tensors) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() // t.element_size()
                    for t in tensors if t is not None and t.untyped_storage().nbytes()}
        return sum(storages.values())

    params = list(engine.module.parameters())
    shards = [g.param_shard for g in engine.groups]
    return {"numel": numel, "param_elements": elements(params),
            "shard_elements": elements(shards), "all_elements": elements(params + shards),
            "states": sorted({u.state.value for u in engine.stage3.units}),
            "param_numels": sorted({p.numel() for p in params})}


def loads_into_module(rank: int) -> dict:
    """Load other weights into `engine.module`, then train one step; every stage and precision."""
    loaded = build(seed=7).state_dict()
    out = {}
    for stage in STAGES:
        for precision in PRECISIONS:
            engine = zeromem.initialize(build(seed=1), config(stage, precision, lr=1e-3))
            initial = engine.full_state_dict()  # masters before anything happens (rank 0)
            engine.module.load_state_dict(loaded)
            masters = engine.full_state_dict()
            seen = whole_state(engine)
            train_step(engine, 0, rank)
            out[stage, precision] = {"initial": initial, "masters": masters, "seen": seen,
                                     "trained": whole_state(engine)}
    try:  # assign=True would swap out the flat-buffer views: refused, not half done
        engine.module.load_state_dict(loaded, assign=True)
        out["assign"] = "accepted"
    except RuntimeError as error:
        out["assign"] = str(error)
    return out


def gathered_modifier(rank: int) -> dict:
    """Rank 0 edits one element inside GatheredParameters(modifier_rank=0), stages 0, 2, 3
    (at stages 0-2 the parameters are whole already: the edit must still reach the master)."""
    out = {}
    for stage in (0, 2, 3):
        for precision in ("bf16", "fp16"):
            engine = zeromem.initialize(build(seed=1), config(stage, precision))
            weight = engine.module.fc1.weight
            with zeromem.GatheredParameters(weight, modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        weight[0, 0] = 0.5
            out[stage, precision] = {  # each rank's own masters (stage 0: each holds them all)
                name: engine.param_states.full(p, MASTER)
                for name, p in engine.module.named_parameters()}
    return out


def drift_from_fp32(rank: int) -> dict:
    """L2(bf16 params - fp32 params) / L2(fp32 update) after 4 AdamW steps, per stage."""
    out = {}
    for stage in (0, 3):
        finals = {}
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            engine = zeromem.initialize(TinyLM(), {
                "train_micro_batch_size_per_gpu": 4, **PRECISIONS[precision],
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage}})
            start = engine.full_state_dict()
            for step in range(4):
                tokens, targets = micro_batch(step, rank, 0)
                engine.backward(engine(tokens, targets))
                engine.step()
            finals[precision] = engine.full_state_dict()
        if rank == 0:
            keys = [k for k in start if k.endswith(("weight", "bias"))]
            flat = {p: torch.cat([finals[p][k].reshape(-1) for k in keys]) for p in finals}
            update = flat["fp32"] - torch.cat([start[k].reshape(-1) for k in keys])
            out[stage] = float((flat["bf16"] - flat["fp32"]).norm() / update.norm())
    return out


SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


def evaluation_engines(rank: int) -> dict:
    """An engine given no optimizer (DeepSpeed's ZeRO-3 inference: HF's Trainer.evaluate()
    before training, DeepSpeed-Chat's reference model), beside a training engine in the same
    process, their calls interleaved; ranks seeded differently."""
    out = {}
    for precision in ("fp32", "bf16"):
        cfg = config(3, precision)
        del cfg["optimizer"]
        evaluator = zeromem.initialize(build(seed=1 + rank), cfg)
        # SGD: Adam would blow up fc1.bias's rounding noise (BatchNorm makes its gradient ~0)
        trainer = zeromem.initialize(build(seed=1 + rank), {**config(3, "fp32"), "optimizer": SGD})
        evaluator.module.eval()
        evaluated, held = [], []
        for step in range(2):
            with torch.no_grad():
                evaluated.append(evaluator(batch(50 + step, 0).to(evaluator.compute_dtype)).float())
            held.append(sum(p.numel() for p in evaluator.module.parameters()))
            train_step(trainer, step, rank)
        # an AdamW trainer's checkpoint loads into the evaluator as it is (weights only)
        adam = zeromem.initialize(build(seed=1 + rank), config(3, "fp32"))
        train_step(adam, 0, rank)
        path = [tempfile.mkdtemp() if rank == 0 else None]
        torch.distributed.broadcast_object_list(path)
        adam.save_checkpoint(path[0])
        evaluator.load_checkpoint(path[0])
        adam.module.eval()
        with torch.no_grad():
            x = batch(60, 0)
            loaded = [evaluator(x.to(evaluator.compute_dtype)).float(), adam(x).float()]
        refused = []
        x = batch(0, rank).to(evaluator.compute_dtype)
        for call in (lambda: evaluator.backward(evaluator(x).float().sum()),
                     evaluator.step):
            try:
                call()
                refused.append("accepted")
            except RuntimeError as error:
                refused.append(str(error))
        out[precision] = {"evaluated": evaluated, "held": held, "refused": refused, "loaded": loaded,
                          "trained": whole_state(trainer)}
    return out


def initialize_twice(rank: int) -> dict:
    """A second engine on a model a stage-3 engine partitioned: refused, naming a parameter
    (it failed deep inside with "shape '[2, -1]' is invalid for input of size 23")."""
    model = build(seed=1)
    zeromem.initialize(model, config(3, "fp32"))
    try:
        zeromem.initialize(model, config(3, "fp32"))
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": ""}


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


def embedder(sparse: bool) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Embedding(13, 5, sparse=sparse), nn.Tanh(), nn.Linear(5, 1))


def tokens(step: int) -> torch.Tensor:
    """The global batch of a step: 8 token ids (each rank takes its 4)."""
    return torch.randint(0, 13, (8,), generator=torch.Generator().manual_seed(step))


def sparse_embedding(rank: int) -> dict:
    """nn.Embedding(sparse=True): a sparse gradient in each bucket (it failed with "reshape
    is not implemented for sparse tensors" at every stage)."""
    out = {}
    for stage in STAGES:
        model = embedder(sparse=True)
        engine = zeromem.initialize(model, {
            "train_batch_size": 8, "zero_optimization": {
                "stage": stage, "stage3_param_persistence_threshold": 0}},
            optimizer=lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9))
        for step in range(3):
            engine.backward(engine(tokens(step)[rank * 4:rank * 4 + 4]).pow(2).mean())
            engine.step()
        out[stage] = whole_state(engine)
    return out


# torch's optimizers beyond Adam and SGD, built by the user over the module (DeepSpeed's
# client optimizer): each updates an element from its own gradient and state only
CLIENT_OPTIMIZERS = {
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.1),
}


def mlp() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))


def param_groups(model: nn.Module) -> list[dict]:
    """HF's split: the weights in one group with an lr of their own, the biases in another."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")],
             "lr": 3e-2}, {"params": [p for n, p in model.named_parameters() if n.endswith("bias")]}]


def client_optimizers(rank: int) -> dict:
    """deepspeed.initialize(optimizer=torch.optim.X(model.parameters())): each elementwise
    optimizer trained 3 steps at stages 0, 2, 3; whole-parameter ones refused before the
    model is touched (Adafactor stepped flat shards, silently wrong; Muon and LBFGS failed
    inside torch)."""
    out: dict = {}
    for name, make in CLIENT_OPTIMIZERS.items():
        for stage in (0, 2, 3):
            model = mlp()
            engine, *_ = zeromem_deepspeed.initialize(
                model=model, optimizer=make(param_groups(model)), config=config(stage, "fp32"))
            for step in range(3):
                engine.backward(engine(batch(step, rank)).pow(2).mean())
                engine.step()
            out[name, stage] = whole_state(engine.engine)  # the zeromem engine inside
    for name, make in {"Adafactor": torch.optim.Adafactor, "LBFGS": torch.optim.LBFGS,
                       "Muon": torch.optim.Muon}.items():
        model = mlp()
        matrices = [p for p in model.parameters() if p.ndim == 2]  # Muon takes nothing else
        try:
            zeromem_deepspeed.initialize(model=model, optimizer=make(matrices), config=config(3, "fp32"))
            out[name] = "accepted"
        except NotImplementedError as error:
            out[name] = {"error": str(error), "numels": [p.numel() for p in model.parameters()]}
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


def model_in_16_bits(rank: int) -> dict:
    """A model loaded in bf16 (fp16) with a config that turns on neither block (HF's
    `torch_dtype=torch.bfloat16` without `--bf16`): it was cast to fp32, twice the memory,
    and 16-bit inputs failed ("mat1 and mat2 must have the same dtype"). Per stage and
    dtype: its trained state and output dtype, and those of an engine given the block."""
    out = {}
    for stage in STAGES:
        for dtype, block in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            runs = []
            for cfg in (config(stage, "fp32"), {**config(stage, "fp32"), block: {"enabled": True}}):
                engine = zeromem.initialize(mlp().to(dtype), {**cfg, "optimizer": SGD})
                for step in range(2):
                    y = engine(batch(step, rank).to(dtype))
                    engine.backward(y.float().pow(2).mean())
                    engine.step()
                runs.append({"state": whole_state(engine), "output": str(y.dtype)})
            out[stage, block] = runs
        frozen = zeromem.initialize(mlp().to(torch.bfloat16).requires_grad_(False),
                                    config(stage, "fp32") | {"optimizer": None})
        with torch.no_grad():  # a frozen teacher in bf16 (no optimizer): its dtype kept too
            out[stage, "frozen"] = str(frozen(batch(0, rank).to(torch.bfloat16)).dtype)
    return out


CASES = {"seeded": seeded_differently, "storages": storages_after_initialize,
         "loads": loads_into_module, "modifier": gathered_modifier, "drift": drift_from_fp32,
         "evaluators": evaluation_engines, "twice": initialize_twice,
         "unfrozen": unfrozen_after_initialize, "sparse": sparse_embedding,
         "client_optimizers": client_optimizers, "distillation": distillation,
         "lora": lora_stage3, "16 bits": model_in_16_bits}


def run_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name, case in CASES.items():
        try:
            # numpy arrays: torch tensors would travel as shared memory the ended rank took away
            results[name] = tree_map(lambda v: v.numpy() if torch.is_tensor(v) else v, case(rank))
        except Exception:  # noqa: BLE001 (one broken case must not hide the others' results)
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(run_cases, WORLD)


def case(ranks: list[dict], name: str) -> list:
    for r, result in enumerate(ranks):
        if isinstance(result[name], str):
            pytest.fail(f"case {name!r} failed on rank {r}:\n{result[name]}")
    return [tree_map(lambda v: torch.from_numpy(v) if isinstance(v, np.ndarray) else v,
                     result[name]) for result in ranks]


def max_diff(a: dict, b: dict, keys=None) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in (keys or a))


def rounded(state: dict, precision: str) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return {k: v.to(dtype).float() if v.is_floating_point() else v.float() for k, v in state.items()}


# ---------------------------------------------------------------- item 1: broadcast

def test_initialize_gives_every_rank_rank0_parameters_and_buffers(ranks):
    per_rank = case(ranks, "seeded")
    for stage, precision in per_rank[0]:
        expected = rounded(build(seed=1).state_dict(), precision)  # rank 0 built from seed 1
        for r, result in enumerate(per_rank):
            diff = max_diff(result[stage, precision]["init"], expected)
            assert diff == 0.0, f"stage {stage} {precision}: rank {r} differs by {diff}"


def test_evaluation_before_the_first_step_matches_rank0_model_on_every_rank(ranks):
    per_rank = case(ranks, "seeded")
    for stage, precision in per_rank[0]:
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        with torch.no_grad():
            expected = build(seed=1).eval().to(dtype)(batch(99, 0).to(dtype)).float()
        for r, result in enumerate(per_rank):
            got = result[stage, precision]["eval"]
            assert torch.allclose(got, expected, atol=1e-6 if dtype == torch.float32 else 2e-2), \
                f"stage {stage} {precision}: rank {r} evaluates another model"


def test_differently_seeded_ranks_keep_identical_parameters_while_training(ranks):
    per_rank = case(ranks, "seeded")
    for key in per_rank[0]:
        trained = [result[key]["trained"] for result in per_rank]
        params = [k for k in trained[0] if k.endswith(("weight", "bias"))]
        for r in range(1, WORLD):
            assert max_diff(trained[r], trained[0], params) == 0.0, f"{key}: rank {r} diverged"


# ---------------------------------------------------------------- item 3: stage-3 memory

def test_stage3_holds_only_shards_right_after_initialize(ranks):
    for r, held in enumerate(case(ranks, "storages")):
        assert held["states"] == ["sharded"]
        assert held["param_numels"] == [0], f"rank {r}: parameters still view whole buffers"
        assert held["param_elements"] == 0, f"rank {r}: {held['param_elements']} elements"
        # this rank's shards (1/N_d plus padding) are all that is held
        assert held["all_elements"] == held["shard_elements"] <= held["numel"] // WORLD + 16


# ---------------------------------------------------------------- an engine given no optimizer

def test_an_engine_given_no_optimizer_evaluates_sharded_beside_a_training_engine(ranks):
    reference = build(seed=1)  # rank 0's model, which initialize gives every rank
    opt = torch.optim.SGD(reference.parameters(), **SGD["params"])
    for step in range(2):
        for rank in range(WORLD):
            (reference(batch(step, rank)).pow(2).mean() / WORLD).backward()
        opt.step()
        opt.zero_grad()
    trained = {k: v.detach() for k, v in reference.named_parameters()}
    expected = rounded(build(seed=1).state_dict(), "fp32")
    for r, result in enumerate(case(ranks, "evaluators")):
        for precision, got in result.items():
            dtype = torch.float32 if precision == "fp32" else torch.bfloat16
            model = build(seed=1).eval().to(dtype)
            for step, output in enumerate(got["evaluated"]):
                with torch.no_grad():
                    want = model(batch(50 + step, 0).to(dtype)).float()
                assert torch.allclose(output, want, atol=1e-6 if precision == "fp32" else 2e-2), \
                    f"{precision}: rank {r} evaluates another model at step {step}"
            assert got["held"] == [0, 0], f"{precision}: rank {r} keeps whole parameters"
            # rank 0's AdamW trainer: its BatchNorm statistics are the ones checkpointed
            trainer_sees = case(ranks, "evaluators")[0][precision]["loaded"][1]
            assert torch.allclose(got["loaded"][0], trainer_sees, atol=1e-6 if precision == "fp32"
                                  else 2e-2), f"{precision}: rank {r} did not load the weights"
            for message in got["refused"]:
                assert "given no optimizer" in message and "evaluates only" in message, message
            assert max_diff(got["trained"], trained, list(trained)) < 1e-5, \
                f"{precision}: rank {r}'s training engine is off its reference"
        assert max_diff(result["fp32"]["trained"], expected, list(trained)) > 1e-3  # it trained


# ---------------------------------------------------------------- items 4 and 7: masters

def test_masters_start_from_the_users_fp32_values(ranks):
    original = build(seed=1).state_dict()
    params = [k for k in original if k.endswith(("weight", "bias"))]
    for key, result in case(ranks, "loads")[0].items():
        if key == "assign":
            continue
        stage, precision = key
        assert max_diff(result["initial"], original, params) == 0.0, f"stage {stage} {precision}"


def test_weights_loaded_into_the_module_reach_the_masters_at_full_precision(ranks):
    loaded = build(seed=7).state_dict()
    params = [k for k in loaded if k.endswith(("weight", "bias"))]
    results = dict(case(ranks, "loads")[0])
    assert "load without assign" in results.pop("assign")
    for (stage, precision), result in results.items():
        assert max_diff(result["masters"], loaded, params) == 0.0, f"stage {stage} {precision}"


def test_weights_loaded_into_the_module_are_used_and_trained_on_every_rank(ranks):
    loaded = build(seed=7).state_dict()
    reference = build(seed=7)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for rank in range(WORLD):  # the global batch: each rank's micro-batch, averaged
        (reference(batch(0, rank)).pow(2).mean() / WORLD).backward()
    opt.step()
    stepped = {k: v.detach() for k, v in reference.named_parameters()}
    per_rank = case(ranks, "loads")
    for key in [k for k in per_rank[0] if k != "assign"]:
        tol = 1e-4 if key[1] == "fp32" else 1e-2
        for r, result in enumerate(per_rank):
            assert max_diff(result[key]["seen"], rounded(loaded, key[1]), list(stepped)) == 0.0, \
                f"{key}: rank {r} does not compute with the loaded weights"
            diff = max_diff(result[key]["trained"], stepped, list(stepped))
            assert diff < tol, f"{key}: rank {r} is {diff} from one step on the loaded weights"


def test_gathered_parameters_modifier_keeps_the_masters_low_bits(ranks):
    original = build(seed=1).state_dict()
    for rank, per_rank in enumerate(case(ranks, "modifier")):
        for (stage, precision), full in per_rank.items():
            expected = dict(original)
            expected["fc1.weight"] = original["fc1.weight"].clone()
            expected["fc1.weight"][0, 0] = 0.5
            params = [k for k in original if k.endswith(("weight", "bias"))]
            assert max_diff(full, expected, params) == 0.0, (rank, stage, precision)


def test_bf16_drifts_from_fp32_no_more_than_its_own_rounding(ranks):
    for stage, drift in case(ranks, "drift")[0].items():
        assert drift < 0.1, f"stage {stage}: bf16 is {drift:.3f} update-norms from fp32"


def test_a_second_engine_on_a_partitioned_model_is_refused_by_name(ranks):
    for rank, got in enumerate(case(ranks, "twice")):
        assert "'fc1.weight' is partitioned by a stage-3 engine" in got["error"], (rank, got)


def test_a_parameter_unfrozen_after_initialize_is_refused_at_the_step(ranks):
    for rank, got in enumerate(case(ranks, "unfrozen")):
        for stage, error in got.items():
            assert "'fc1." in error and "frozen (requires_grad=False)" in error, (rank, stage, error)


def test_sparse_embedding_gradients_train_like_dense_ones_in_one_process(ranks):
    model = embedder(sparse=False)  # the same gradients, dense: SGD with momentum takes them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        model(tokens(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    want = model.state_dict()
    for rank, got in enumerate(case(ranks, "sparse")):
        for stage, state in got.items():
            assert max_diff(state, want) < 1e-6, (rank, stage)


def test_torchs_elementwise_client_optimizers_match_one_process_on_every_rank(ranks):
    got = case(ranks, "client_optimizers")
    for name, make in CLIENT_OPTIMIZERS.items():
        model = mlp()
        optimizer = make(param_groups(model))
        for step in range(3):  # the global batch: both ranks' micro-batches
            model(torch.cat([batch(step, 0), batch(step, 1)])).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        want = model.state_dict()
        assert max_diff(want, mlp().state_dict()) > 1e-3, name  # it trained
        for rank, per_rank in enumerate(got):
            for stage in (0, 2, 3):
                assert max_diff(per_rank[name, stage], want) < 1e-6, (name, rank, stage)


def test_whole_parameter_client_optimizers_are_refused_before_the_model_is_touched(ranks):
    numels = [p.numel() for p in mlp().parameters()]
    for rank, per_rank in enumerate(case(ranks, "client_optimizers")):
        for name, said in (("Adafactor", "row and column means"), ("LBFGS", "closure"),
                           ("Muon", "orthogonalises")):
            assert said in per_rank[name]["error"], (rank, name, per_rank[name])
            assert per_rank[name]["numels"] == numels, (rank, name)  # not partitioned


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


def test_a_model_loaded_in_16_bits_trains_in_them_as_with_the_block(ranks):
    for rank, got in enumerate(case(ranks, "16 bits")):
        for stage in STAGES:
            assert got.pop((stage, "frozen")) == "torch.bfloat16", (rank, stage)
        for (stage, block), (inferred, given) in got.items():
            assert inferred["output"] == given["output"] != "torch.float32", (rank, stage, block)
            assert max_diff(inferred["state"], given["state"]) == 0, (rank, stage, block)
