"""Small models, a single-process reference trainer and gradient / storage probes shared by the tests."""
from __future__ import annotations

import enum
import gc
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TinyLM(nn.Module):
    """Odd sizes (forces padding), a tied head, a frozen layer and a sometimes-unused one."""

    def __init__(self, vocab: int = 13, dim: int = 10, hidden: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.sometimes = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.checkpointed = False  # run the MLP under zeromem.checkpoint

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(h)))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, use_sometimes: bool = True):
        h = self.embed(tokens)                      # (B, T, dim)
        h = h + self.frozen(h)
        if self.checkpointed:
            from zeromem import checkpoint
            h = checkpoint(self.mlp, h)
        else:
            h = self.mlp(h)
        if use_sometimes:
            h = h + self.sometimes(h)
        logits = self.head(h)                       # (B, T, vocab)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class PositionEmbeddingType(enum.Enum):
    """As Megatron-DeepSpeed's (megatron/model/enums.py), whose saved `args` hold one: the
    client state of tools/make_deepspeed_checkpoints.py's `_client_state` case."""
    absolute = 1
    rotary = 2


def micro_batch(step: int, rank: int, micro: int, batch: int = 4, seq: int = 5, vocab: int = 13):
    """A deterministic micro-batch for (step, rank, micro-step)."""
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    return tokens, targets


def unclipped_config(stage: int, micro_batch: int, optimizer: dict, **zero) -> dict:
    """A zeromem config as the checkpoint-import tests write it: gradients unclipped (SGD
    and Adam then see them as they are), every stage-3 parameter partitioned (persistence
    threshold 0); `zero`: more zero_optimization keys."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 0.0,
            "optimizer": optimizer,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def decay_groups(model: nn.Module) -> list[dict]:
    """Hugging Face's (and nanoGPT's) two param groups of the trained parameters, in the
    model's order: weight decay on matrices, none on biases and norms."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trained if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}]


def client_optimizer(groups: list[dict]) -> tuple:
    """What a script gives `initialize` as its own optimizer and schedule: SGD with momentum
    and HF's linear schedule (2 warmup steps from 0, then down to 0 at step 10), over
    torch-style param groups (DeepSpeed checkpoints' client_optimizer cases)."""
    optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay)
    return optimizer, schedule


def linear_warmup_decay(step: int) -> float:
    return step / 2 if step < 2 else max(0.0, (10 - step) / 8)


def uses_sometimes(step: int, rank: int, micro: int, per_rank: bool = True) -> bool:
    """The `sometimes` layer is skipped on some (rank, micro-step) pairs, differently per rank.

    Stage 3 gathers a module's parameters collectively, so there every rank must run
    the same modules (`per_rank=False`), as with DeepSpeed and FSDP.
    """
    return (step + rank * per_rank + micro) % 3 != 0


class Reference:
    """Single-process training on the whole global batch, with torch.optim and clip_grad_norm_.

    `optimizer="sgd"` uses SGD with `momentum` and no weight decay: unlike AdamW it sees the
    gradient's magnitude, so a missing 1/N_d, 1/accumulation or 1/loss-scale shows up.
    `data(step, rank, micro)` gives the micro-batches (default `micro_batch`); `last_norm`
    is the pre-clip global gradient norm of the last step.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-2, clip: float = 0.0,
                 weight_decay: float = 0.01, per_rank: bool = True, optimizer: str = "adamw",
                 momentum: float = 0.9, data=micro_batch):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if optimizer == "sgd":
            self.opt = torch.optim.SGD(self.params, lr=lr, momentum=momentum)
        else:
            self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.clip = clip
        self.per_rank = per_rank
        self.data = data
        self.last_norm = 0.0

    def step(self, step: int, world_size: int, gas: int) -> None:
        for p in self.params:  # a parameter no micro-batch reaches gets a zero gradient, as in ZeRO
            p.grad = torch.zeros_like(p)
        n = world_size * gas
        for rank in range(world_size):
            for micro in range(gas):
                tokens, targets = self.data(step, rank, micro)
                loss = self.model(tokens, targets, uses_sometimes(step, rank, micro, self.per_rank))
                (loss / n).backward()
        # max_norm inf: only measures (clip_grad_norm_ with the real clip below scales too)
        self.last_norm = float(torch.nn.utils.clip_grad_norm_(self.params, float("inf")))
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()


def state_dict_diff(full: dict, model: nn.Module) -> float:
    """Max abs difference between `engine.full_state_dict()` and `model` (0.0 when `full` is {})."""
    ref = model.state_dict()
    return max((full[k].float() - ref[k].float()).abs().max().item() for k in full) if full else 0.0


def own_view_diff(engine, model: torch.nn.Module) -> float:
    """Max abs difference between what this rank holds and `model`, on any rank.

    Compares the rank's master shard and compute-dtype parameter shard (the owned part of
    each parameter, `FlatParamGroup.owned_slice`) and, where parameters are whole (stages
    0-2), every parameter in the flat buffer the module computes with. A `torch.compile`d
    module's names (`_orig_mod.`) are read as the uncompiled model's.
    """
    worst = 0.0
    for g in engine.groups:
        for slot in g.slots:
            name = slot.name.replace("_orig_mod.", "")
            ref = model.get_parameter(name).detach().float().flatten()
            start, param_start, length = g.owned_slice(slot)
            want = ref[param_start:param_start + length]
            for shard in (g.master, g.param_shard):
                got = shard.detach().float().cpu()[start:start + length]
                worst = max(worst, (got - want).abs().max().item() if length else 0.0)
            if g.flat_param is not None:
                whole = g.flat_param.detach().float().cpu()[slot.offset:slot.offset + slot.numel]
                worst = max(worst, (whole - ref).abs().max().item())
    return worst


class Deep(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


class BufferedLM(TinyLM):
    """TinyLM (tied head, frozen layer) with a buffer, which checkpoints must carry too."""

    def __init__(self, dim: int = 10, extra: bool = False):
        super().__init__(dim=dim)
        self.register_buffer("position", torch.arange(5.0))
        if extra:
            self.extra = nn.Linear(dim, 2)


class Gain(nn.Module):
    """`h * weight`: autograd saves the parameter itself, so backward reads its current value."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.weight


class GainLM(TinyLM):
    """TinyLM with a `Gain` inside its MLP.

    A Linear saves `weight.t()`, a view of the buffer its forward gathered, so its
    backward never reads what stage 3 re-gathers. `Gain`'s backward does: a wrong
    backward gather (hpZ's secondary copies) shows in the gradients only here.
    """

    def __init__(self):
        super().__init__()
        self.gain = Gain(self.fc1.out_features)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.gain(torch.tanh(self.fc1(h))))


# ---------------------------------------------------------------- gradients and storage, measured

def grads_of(x, module) -> list[torch.Tensor]:
    """The gradients of `x` (when it has one) and of `module`'s parameters; then clears them."""
    out = ([x.grad.clone()] if x is not None and x.grad is not None else [])
    out += [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    if x is not None:
        x.grad = None
    return out


def assert_all_close(a, b):
    """Two lists of tensors equal within fp32 round-off."""
    assert len(a) == len(b)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


class StorageTracker(TorchDispatchMode):
    """Weak references to every storage an op creates; `held_bytes` sums those still alive."""

    def __init__(self):
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs.append((StorageWeakRef(storage), storage.nbytes()))
        return out

    def held_bytes(self, exclude) -> int:
        skip = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
        alive = {r.cdata: n for r, n in self.refs if not r.expired() and r.cdata not in skip}
        return sum(alive.values())

    def settled_held_bytes(self, exclude, tries: int = 50) -> int:
        """`held_bytes` once two reads 10 ms apart agree: gloo's worker thread may still
        hold a collective's tensor for a moment after `wait()` returned (seen under load)."""
        held = -1
        for _ in range(tries):
            gc.collect()
            now = self.held_bytes(exclude)
            if now == held:
                break
            held = now
            time.sleep(0.01)
        return held


class SparseExperts(nn.Module):
    """A sparse MoE block: each sample goes to the expert its gate picks, so the experts a
    rank runs, and their order, depend on its data."""

    def __init__(self, width: int = 4, experts: int = 3):
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i in choice.unique().tolist():  # only the experts some sample chose
            out[choice == i] = self.experts[i](x[choice == i])
        return x + out
