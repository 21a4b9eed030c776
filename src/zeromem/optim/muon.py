"""Muon over ZeRO's flat master shards: DeepSpeed's `"optimizer": {"type": "Muon"}`.

Muon (Jordan et al., 2024) steps each weight matrix by the orthogonalised Nesterov
momentum of its gradient: m = b m + (1 - b) g; u = g + b (m - g); O = NS5(u), the quintic
Newton-Schulz iteration in bf16 that maps u's singular values near 1; W -= lr (wd W +
sqrt(max(1, rows / cols)) O). That is torch.optim.Muon's update with its default learning
rate adjustment. The other parameters (vectors, embeddings, the head: DeepSpeed's
`use_muon` tags) take Adam with decoupled weight decay, as DeepSpeed's MuonWithAuxAdam
gives them; each kind is a param group of its own (`muon_groups`).

The momentum is elementwise, so it lives in shards like Adam's moments. The
orthogonalisation needs each matrix whole: the step all-gathers the shards of u (in bf16,
the dtype NS5 runs in: the bytes of one parameter all-gather) and each rank
orthogonalises the matrices that overlap its shard, keeping its own part of O. A matrix
split across ranks is orthogonalised on each of them, from the same gathered values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's, chosen for the slope at zero
# DeepSpeed's Muon hyper-parameters where a config leaves them out (its MuonWithAuxAdam)
MUON_LR, ADAM_LR = 0.02, 3e-4


def orthogonalize(u: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """NS5 of a matrix, in bf16 (torch.optim.Muon's iteration): about U V^T of u = U S V^T."""
    x = u.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def uses_muon(name: str, p: nn.Parameter) -> bool:
    """The user's `use_muon` tag where set, else DeepSpeed's rule: Muon for weight matrices
    but the embeddings' and the head's, Adam for the rest."""
    if hasattr(p, "use_muon"):
        return bool(p.use_muon)
    shape = getattr(p, "ds_shape", p.shape)  # a stage-3 shard keeps the whole shape
    return len(shape) >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def tag_matrices(module: nn.Module) -> None:
    """Give every parameter its `use_muon` tag (`uses_muon`), as DeepSpeed's initialize does."""
    for name, p in module.named_parameters():
        p.use_muon = uses_muon(name, p)  # type: ignore[attr-defined]


def muon_groups(module: nn.Module, param_groups: list[dict]) -> list[dict]:
    """Each param group split in two, Muon's matrices and Adam's others (`use_muon`), each
    keeping the group's own options."""
    tag_matrices(module)
    halves = []
    for group in param_groups:
        for use_muon in (True, False):
            params = [p for p in group["params"] if bool(p.use_muon) is use_muon]
            if params:
                halves.append({**group, "params": params, "use_muon": use_muon})
    return halves


@dataclass(frozen=True)
class Piece:
    """One parameter of a flat group, and the part of it a rank's shard holds."""

    offset: int  # in the whole flat group
    numel: int
    shape: torch.Size
    start: int  # of the owned part, in the shard
    begin: int  # of the owned part, in the parameter
    length: int  # of the owned part (0: none)


@dataclass(frozen=True)
class Matrices:
    """How a master shard's flat group is made whole: its pieces, and the gather of a
    shard-sized tensor into the whole (padded) flat group on every rank."""

    pieces: tuple[Piece, ...]
    gather: Callable[[torch.Tensor], torch.Tensor]


class ShardedMuon(torch.optim.Optimizer):
    """Muon for groups with `use_muon`, Adam for the others; see the module docstring.

    `lr` sets both kinds; `muon_lr` and `adam_lr` each one (DeepSpeed's keys); a group's own
    `lr` wins. `ns_method`: DeepSpeed's "gram" and "standard" name two ways to compute the
    same iteration; both run the standard one here.
    """

    def __init__(self, params, lr: float | None = None, muon_lr: float | None = None,
                 adam_lr: float | None = None, momentum: float = 0.95, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-10,
                 ns_method: str = "gram", nesterov: bool = True, ns_steps: int = 5,
                 adam_w_mode: bool = True):
        if ns_method not in ("gram", "standard"):
            raise ValueError(f"ns_method must be 'gram' or 'standard', got {ns_method!r}")
        kinds: dict[bool, dict[str, Any]] = {True: dict(lr=_first(muon_lr, lr, MUON_LR), momentum=momentum,
                            nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay),
                 False: dict(lr=_first(adam_lr, lr, ADAM_LR), betas=tuple(betas), eps=eps,
                             weight_decay=weight_decay, adam_w_mode=adam_w_mode)}
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        # each group takes its kind's options where it sets none
        groups = [{**kinds[bool(g.get("use_muon", False))], **g,
                   "use_muon": bool(g.get("use_muon", False))} for g in groups]
        super().__init__(groups, {"ns_method": ns_method})
        self._matrices: dict[int, Matrices] = {}

    @property
    def state_bytes_per_param(self) -> float:
        """Muon's momentum (4 bytes) for its elements, Adam's two moments (8) for the others."""
        numels = {True: 0, False: 0}
        for group in self.param_groups:
            numels[group["use_muon"]] += sum(p.numel() for p in group["params"])
        total = numels[True] + numels[False]
        return (4 * numels[True] + 8 * numels[False]) / total if total else 8.0

    def whole(self, shard: torch.Tensor, matrices: Matrices) -> None:
        """Tell the step how `shard` (a master shard of Muon's) is made whole."""
        self._matrices[id(shard)] = matrices

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon if group["use_muon"] else self._adam)(p, group)
        return loss

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, grad = state["momentum_buffer"], p.grad
        assert grad is not None
        buf.lerp_(grad, 1 - group["momentum"])
        u = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        update = self._orthogonalized(p, u, group["ns_steps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"])

    def _orthogonalized(self, p: torch.Tensor, u: torch.Tensor, steps: int) -> torch.Tensor:
        """This shard's part of each overlapping matrix's scaled NS5, gathered whole first."""
        matrices = self._matrices.get(id(p))
        if matrices is None:  # a tensor of its own, not a flat shard
            matrices = Matrices((Piece(0, p.numel(), p.shape, 0, 0, p.numel()),), lambda t: t)
        whole = matrices.gather(u.bfloat16())
        update = torch.zeros_like(p)
        flat = update.view(-1)
        for piece in matrices.pieces:
            if piece.length == 0:
                continue
            matrix = whole[piece.offset:piece.offset + piece.numel].view(piece.shape[0], -1)
            if matrix.size(1) == 0 or len(piece.shape) < 2:
                raise ValueError(f"Muon steps matrices; a parameter of shape {tuple(piece.shape)} "
                                 "is tagged use_muon")
            rows, cols = matrix.shape
            o = orthogonalize(matrix, steps).reshape(-1)[piece.begin:piece.begin + piece.length]
            flat[piece.start:piece.start + piece.length] = \
                o.to(update.device, update.dtype) * math.sqrt(max(1.0, rows / cols))
        return update

    def _adam(self, p: torch.Tensor, group: dict) -> None:
        """Adam with bias correction and eps outside the root; decoupled decay, or L2 without
        `adam_w_mode` (DeepSpeed's MuonWithAuxAdam for parameters that are not matrices)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        grad, decay = p.grad, group["weight_decay"]
        assert grad is not None
        if not group["adam_w_mode"]:
            grad, decay = grad.add(p, alpha=decay), 0.0  # L2: through the moments
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.lerp_(grad.square(), 1 - beta2)
        update = (m / (1 - beta1 ** step)).div_((v / (1 - beta2 ** step)).sqrt_().add_(group["eps"]))
        p.mul_(1 - group["lr"] * decay)
        p.add_(update, alpha=-group["lr"])


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)


def whole_matrices(optimizer: ShardedMuon, flat_groups: list, device: torch.device) -> None:
    """Tell Muon how each of its master shards is made whole: the pieces of the flat group,
    and an all-gather over the ranks that share it (through `device`, the one the backend
    moves tensors on: host masters under NCCL go through the GPU)."""
    muon = {id(p) for group in optimizer.param_groups if group["use_muon"] for p in group["params"]}
    for g in flat_groups:
        if id(g.master) not in muon:
            continue
        pieces = tuple(Piece(s.offset, s.numel, s.shape, *g.layout.owned_slice(s.offset, s.numel))
                       for s in g.slots)
        optimizer.whole(g.master, Matrices(pieces, _gathered(g, device)))


def _gathered(group, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    def gather(shard: torch.Tensor) -> torch.Tensor:
        shard = shard.to(device)
        if group.layout.world == 1:
            return shard
        whole = torch.empty(shard.numel() * group.layout.world, dtype=shard.dtype, device=device)
        group.comm.all_gather(whole, shard, kind="muon_gather")
        return whole
    return gather
