"""DeepSpeed's own optimizers that torch lacks, with DeepSpeed's math: Lamb, Adam without bias
correction, Lion.

- `Lamb` is DeepSpeed's FusedLamb (csrc/lamb/fused_lamb_cuda_kernel.cu), per parameter p:

      m = b1 m + (1 - b1) g                v = b2 v + (1 - b2) g^2
      u = m / (sqrt(v) + eps) + wd p       (eps_inside_sqrt: m / sqrt(v + eps) + wd p)
      ratio = clamp(|p| / |u|, min_coeff, max_coeff)   (1 when |p| or |u| is 0)
      p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * ratio * u   (no bias_correction: lr * ratio * u)

  The trust ratio is a property of the whole parameter. Under ZeRO the optimizer sees flat
  shards holding parts of many parameters, and a parameter may straddle ranks: `split`
  tells Lamb which elements of a shard belong to which parameter and how to sum the
  parts' squared norms over the ranks, so the ratio is the one of the whole parameter
  (DeepSpeed's ZeRO would take it per flat partition, and refuses Lamb under ZeRO unless
  zero_allow_untested_optimizer is set). Without `split`, each tensor is one parameter.
- `Adam` is DeepSpeed's FusedAdam, used for `"bias_correction": false` (torch's Adam always
  corrects): m / bc1 / (sqrt(v / bc2) + eps), with bc = 1 when not correcting; decoupled
  weight decay when `adam_w_mode`, else L2 (added to the gradient).
- `Lion` is DeepSpeed's FusedLion: p *= 1 - lr wd; p -= lr sign(b1 m + (1 - b1) g);
  m = b2 m + (1 - b2) g.

Every update but Lamb's ratio is elementwise, so they step flat shards as they step whole
tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

Reduce = Callable[[torch.Tensor], None]  # sums a float tensor over the ranks, in place


@dataclass
class _Split:
    """Which parameter each element of a tensor belongs to (`segments` ids, `count` of them;
    id `count` marks padding) and how to sum per-parameter values over ranks."""

    segments: torch.Tensor
    count: int
    reduce: Reduce | None


def _state_step(state: dict, like: torch.Tensor, moments: Iterable[str]) -> torch.Tensor:
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        for name in moments:
            state[name] = torch.zeros_like(like, memory_format=torch.preserve_format)
    state["step"] += 1
    return state["step"]


def _closure_loss(closure):
    """torch's closure convention: re-evaluate the loss with gradients enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _PerParameter(torch.optim.Optimizer):
    """An optimizer whose update of each parameter needs only that parameter's own state."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        raise NotImplementedError


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019) as DeepSpeed's FusedLamb computes it; see the module docstring."""

    state_bytes_per_param = 8  # exp_avg, exp_avg_sq

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False):
        if amsgrad:
            raise ValueError("Lamb has no AMSGrad variant (DeepSpeed's FusedLamb neither)")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self._splits: dict[int, _Split] = {}
        self.last_ratios: list[torch.Tensor] = []  # per tensor: the ratio of each parameter

    def split(self, tensor: torch.Tensor, segments: torch.Tensor, count: int,
              reduce: Reduce | None) -> None:
        """`tensor` holds parts of `count` parameters: element i belongs to parameter
        `segments[i]` (`count` for padding). `reduce` sums a tensor over the ranks holding
        the other parts (None: every part is here)."""
        if segments.shape != (tensor.numel(),):
            raise ValueError(f"segments must have {tensor.numel()} ids, got {tuple(segments.shape)}")
        self._splits[id(tensor)] = _Split(segments.to(tensor.device, torch.long), count, reduce)

    def _direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """u = m / denom + wd p, from the moments already updated this step."""
        state = self.state[p]
        v = state["exp_avg_sq"]
        denom = (v + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
        update = state["exp_avg"] / denom
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        return update

    def _square_sums(self, p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """[|p part|^2 per parameter..., |u part|^2 per parameter...] of this tensor."""
        split = self._splits.get(id(p))
        if split is None:
            return torch.stack([p.float().square().sum(), update.float().square().sum()])
        sums = torch.zeros(2, split.count + 1, dtype=torch.float32, device=p.device)
        sums[0].index_add_(0, split.segments, p.float().square().view(-1))
        sums[1].index_add_(0, split.segments, update.float().square().view(-1))
        return sums[:, :split.count].reshape(-1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        live: list[tuple[torch.Tensor, dict]] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                _state_step(state, p, ("exp_avg", "exp_avg_sq"))
                g = p.grad
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                live.append((p, group))
        # Phase 1: squared norms of each parameter's weights and update, summed over ranks
        # (one reduction per communicator, for every tensor at once).
        sums = [self._square_sums(p, self._direction(p, group)) for p, group in live]
        by_reduce: dict[int, list[int]] = {}
        for i, (p, _) in enumerate(live):
            split = self._splits.get(id(p))
            if split is not None and split.reduce is not None:
                by_reduce.setdefault(id(split.reduce), []).append(i)
        for indices in by_reduce.values():
            flat = torch.cat([sums[i] for i in indices])
            self._splits[id(live[indices[0]][0])].reduce(flat)  # type: ignore[misc]
            for i, part in zip(indices, flat.split([sums[i].numel() for i in indices])):
                sums[i] = part
        # Phase 2: the trust ratio of each parameter, and the step (the direction again:
        # recomputing it costs less memory than keeping one per tensor).
        self.last_ratios = []
        for (p, group), square in zip(live, sums):
            w_norm, u_norm = square.view(2, -1).sqrt()
            ratio = (w_norm / u_norm).clamp_(group["min_coeff"], group["max_coeff"])
            ratio = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
            self.last_ratios.append(ratio)
            step = float(self.state[p]["step"])
            beta1, beta2 = group["betas"]
            size = group["lr"]
            if group["bias_correction"]:
                size *= math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
            direction = self._direction(p, group)
            split = self._splits.get(id(p))
            if split is None:
                direction.mul_(ratio[0])
            else:  # each element by its parameter's ratio (padding: 1, its values are 0)
                direction.view(-1).mul_(torch.cat([ratio, ratio.new_ones(1)])[split.segments])
            p.add_(direction, alpha=-size)
        return loss


class Adam(_PerParameter):
    """DeepSpeed's FusedAdam math, for `bias_correction=False` (torch's Adam always corrects)."""

    state_bytes_per_param = 8

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        adam_w_mode=adam_w_mode, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        decay = group["weight_decay"]
        state = self.state[p]
        step = float(_state_step(state, p, ("exp_avg", "exp_avg_sq")))
        g = p.grad
        assert g is not None  # _PerParameter skips parameters without one
        if decay and not group["adam_w_mode"]:
            g = g.add(p, alpha=decay)  # L2: the decay goes through the moments
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1, bc2 = ((1 - beta1 ** step, 1 - beta2 ** step) if group["bias_correction"]
                    else (1.0, 1.0))
        update = (m / bc1).div_((v / bc2).sqrt_().add_(group["eps"]))
        if decay and group["adam_w_mode"]:
            update.add_(p, alpha=decay)
        p.add_(update, alpha=-group["lr"])


class Lion(_PerParameter):
    """Lion (Chen et al. 2023) as DeepSpeed's FusedLion computes it."""

    state_bytes_per_param = 4  # exp_avg

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _update(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[p]
        _state_step(state, p, ("exp_avg",))
        m, g = state["exp_avg"], p.grad
        assert g is not None  # _PerParameter skips parameters without one
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(m.mul(beta1).add_(g, alpha=1 - beta1).sign_(), alpha=-group["lr"])
        m.mul_(beta2).add_(g, alpha=1 - beta2)
