"""Block-wise symmetric quantization for ZeRO++'s quantized collectives (arXiv 2306.10209, 3.1, 3.3).

A row of `numel` values is cut into blocks of `block` elements; each block keeps one
fp32 scale (its largest magnitude over qmax, qmax = 127 for int8 and 7 for int4) and
its values as round(x / scale) in [-qmax, qmax]. Dequantizing gives back x to within
scale / 2 = max|block| / (2 qmax) per element: the bound `max_error` states and the
unit tests check.

On the wire a row is one uint8 buffer, `[payload | scales]`: int8 one byte per value,
int4 two values per byte (offset by 8 into 0..15), then the scales' bytes (the last
block may be short: only the scales are per block, the payload is per value). So a
collective of packed rows moves one tensor, and `packed_nbytes` is exactly what the
ledger counts. Pure tensor arithmetic: no process group.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per block


def qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"quantization to {bits} bits: only 4 and 8 are supported")
    return 2 ** (bits - 1) - 1


def padded_row(numel: int, block: int) -> int:
    """`numel` rounded up to whole blocks."""
    return -(-numel // block) * block


def payload_nbytes(numel: int, bits: int) -> int:
    return -(-numel * bits // 8)


def packed_nbytes(numel: int, bits: int, block: int) -> int:
    """Bytes of one packed row of `numel` values: payload, then one fp32 scale per block."""
    return payload_nbytes(numel, bits) + -(-numel // block) * SCALE_BYTES


def max_error(values: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Per block of a row: the largest error dequantization may show (max|block| / 2 qmax)."""
    blocks = _blocks(values.reshape(1, -1).float(), block)
    return blocks.abs().amax(dim=-1).reshape(-1) / (2 * qmax(bits))


def pack(rows: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Quantize each row of `rows` (R, numel) into one packed uint8 row: (R, packed_nbytes)."""
    limit = qmax(bits)
    blocks = _blocks(rows.float(), block)                       # (R, nblocks, block)
    scales = blocks.abs().amax(dim=-1, keepdim=True) / limit    # (R, nblocks, 1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe).clamp_(-limit, limit).to(torch.int16) + (limit + 1)
    numel = rows.shape[1] + rows.shape[1] % 2 * (bits == 4)     # int4: whole bytes
    q = q.to(torch.uint8).reshape(rows.shape[0], -1)[:, :numel]  # in 1..2*qmax+1
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)                      # two values per byte
    scale_bytes = scales.reshape(rows.shape[0], -1).contiguous().view(torch.uint8)
    return torch.cat([q, scale_bytes], dim=1)


def unpack(packed: torch.Tensor, numel: int, bits: int, block: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rows `pack` packed, dequantized: (R, numel) in `dtype`."""
    limit = qmax(bits)
    rows, padded = packed.shape[0], padded_row(numel, block)
    payload = payload_nbytes(numel, bits)
    q = packed[:, :payload]
    if bits == 4:
        q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(rows, -1)
    values = q[:, :numel].to(torch.float32) - (limit + 1)
    values = torch.nn.functional.pad(values, (0, padded - numel)).view(rows, -1, block)
    scales = packed[:, payload:].contiguous().view(torch.float32)     # (R, nblocks)
    values = values * scales.unsqueeze(-1)
    return values.reshape(rows, padded)[:, :numel].to(dtype)


def _blocks(rows: torch.Tensor, block: int) -> torch.Tensor:
    """(R, numel) -> (R, nblocks, block), zero-padded to whole blocks."""
    pad = padded_row(rows.shape[1], block) - rows.shape[1]
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], -1, block)
