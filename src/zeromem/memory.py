"""Memory ledger: bytes actually held, beside the paper's formula (ZeRO section 5).

The ledger counts the tensors the engine owns (flat parameter buffers, gradient
buffers, fp32 masters, optimizer states, temporary communication buffers), each
once even when two roles share storage, and files them by category and place.
The formula is the paper's, with the byte widths of this run:

    stage 0: (p + g + K) Psi        stage 1: (p + g) Psi + K Psi / N_d
    stage 2: p Psi + (g + K) Psi/N_d  stage 3: (p + g + K) Psi / N_d

where p and g are the parameter and gradient widths (2 and 2 in mixed
precision) and K the master-plus-optimizer bytes per parameter (12 for Adam).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

CATEGORIES = ("params", "grads", "master_params", "optimizer_states", "comm_buffers",
              "activation_checkpoints")
PLACES = ("device", "host", "nvme")


def model_state_formula(psi: float, n_d: int, stage: int, param_bytes: int = 2,
                        grad_bytes: int = 2, k: float = 12, master_bytes: int = 4) -> dict[str, float]:
    """Per-device model-state bytes by category for `psi` parameters (paper, section 5).

    K counts the fp32 master (`master_bytes`: 4, or 0 when fp32 training updates the
    parameters in place) plus the optimizer states (8 for Adam).
    """
    master = min(master_bytes, k)
    state_bytes = k - master
    shard = {"params": stage >= 3, "grads": stage >= 2, "master_params": stage >= 1,
             "optimizer_states": stage >= 1}
    width = {"params": param_bytes, "grads": grad_bytes, "master_params": master,
             "optimizer_states": state_bytes}
    return {c: psi * w / (n_d if shard[c] else 1) for c, w in width.items()}


@dataclass
class MemoryReport:
    """Bytes held per category and place, with the paper's formula for comparison."""

    held: dict[str, dict[str, int]]
    formula: dict[str, float]
    psi: int
    n_d: int
    stage: int
    comm_buffer_peak: int = 0
    notes: list[str] = field(default_factory=list)

    def model_state_bytes(self, place: str | None = None) -> int:
        """Params + grads + master + optimizer states actually held (all places by default)."""
        cats = ("params", "grads", "master_params", "optimizer_states")
        return sum(b for c in cats for p, b in self.held.get(c, {}).items() if place in (None, p))

    def formula_bytes(self) -> float:
        return sum(self.formula.values())

    def to_dict(self) -> dict:
        return {"held": self.held, "formula": self.formula, "psi": self.psi, "n_d": self.n_d,
                "stage": self.stage, "comm_buffer_peak": self.comm_buffer_peak,
                "model_state_bytes": self.model_state_bytes(),
                "formula_bytes": self.formula_bytes(), "notes": self.notes}

    def __str__(self) -> str:
        mb = 1e6
        head = (f"memory per rank (stage {self.stage}, N_d={self.n_d}, Psi={self.psi:,}) "
                "in MB; formula = ZeRO paper with this run's byte widths")
        rows = [head, f"{'category':<24}{'device':>10}{'host':>10}{'nvme':>10}{'formula':>10}"]
        for c in CATEGORIES:
            held = self.held.get(c, {})
            f = self.formula.get(c)
            rows.append(f"{c:<24}" + "".join(f"{held.get(p, 0) / mb:>10.2f}" for p in PLACES)
                        + (f"{f / mb:>10.2f}" if f is not None else f"{'-':>10}"))
        total = self.model_state_bytes()
        rows.append(f"{'model states':<24}{total / mb:>30.2f}{self.formula_bytes() / mb:>10.2f}"
                    f"   (measured/formula = {total / max(self.formula_bytes(), 1):.3f})")
        rows.append(f"{'comm buffer peak':<24}{self.comm_buffer_peak / mb:>10.2f}")
        rows += self.notes
        return "\n".join(rows)


class Ledger:
    """Collects (category, place, tensor) triples, counting each storage once."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._seen: set[int] = set()

    def add(self, category: str, place: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return
        key = tensor.untyped_storage().data_ptr()
        if key in self._seen:
            return  # an alias of something already counted (fp32 master == fp32 params)
        self._seen.add(key)
        self.held[category][place] += tensor.untyped_storage().nbytes()

    def add_bytes(self, category: str, place: str, nbytes: int) -> None:
        self.held[category][place] += int(nbytes)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {c: dict(p) for c, p in self.held.items()}
