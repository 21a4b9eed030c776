"""The paper's model-state formula (memory.py; ZeRO, section 5, figure 1). No process group."""
from __future__ import annotations

import pytest

from zeromem.memory import model_state_formula


def test_formula_reproduces_paper_figure_1():
    gb = 1e9
    psi, n = 7.5e9, 64
    totals = [sum(model_state_formula(psi, n, s).values()) / gb for s in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], rel=5e-3)
