"""Block-wise quantization (hybrid/quantize.py): the error bound per block and the bytes on the wire."""
from __future__ import annotations

import pytest
import torch

from zeromem.hybrid import quantize


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("numel", [1, 7, 64, 1000])
def test_dequantized_values_are_within_half_a_step_of_each_block(bits, numel):
    block = 64
    g = torch.Generator().manual_seed(numel + bits)
    rows = torch.randn(3, numel, generator=g) * torch.tensor([[1e-3], [1.0], [50.0]])
    rows[1, : min(numel, block)] = 0.0  # an all-zero block comes back exactly
    packed = quantize.pack(rows, bits, block)
    assert packed.dtype == torch.uint8 and packed.shape == (3, quantize.packed_nbytes(numel, bits, block))
    back = quantize.unpack(packed, numel, bits, block)
    for r in range(3):
        bound = quantize.max_error(rows[r], bits, block)                 # per block
        error = torch.nn.functional.pad((back[r] - rows[r]).abs(),
                                        (0, quantize.padded_row(numel, block) - numel))
        worst = error.view(-1, block).amax(dim=1)
        assert (worst <= bound * (1 + 1e-5) + 1e-12).all(), (r, worst, bound)
    assert (back[1, : min(numel, block)] == 0).all()
    # the bound is tight enough to mean something: 8 bits keep ~1/254 of the block's range
    assert quantize.max_error(torch.ones(block), bits, block).item() == pytest.approx(
        1 / (2 * quantize.qmax(bits)))


def test_packed_bytes_are_a_quarter_or_half_of_bf16_plus_scales():
    numel, block = 4096, 256
    assert quantize.packed_nbytes(numel, 8, block) == numel + 16 * 4
    assert quantize.packed_nbytes(numel, 4, block) == numel // 2 + 16 * 4
    assert quantize.packed_nbytes(5, 4, 4) == 3 + 2 * 4  # a short last block, an odd count
    with pytest.raises(ValueError, match="only 4 and 8"):
        quantize.pack(torch.ones(1, 4), 2, 4)


def test_bf16_rows_round_trip_in_their_dtype():
    rows = torch.randn(2, 300).to(torch.bfloat16)
    back = quantize.unpack(quantize.pack(rows, 8, 32), 300, 8, 32, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert (back.float() - rows.float()).abs().max() <= rows.float().abs().max() / 127
