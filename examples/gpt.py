"""A small GPT-style decoder: the demo's and the benchmarks' model.

Byte-level vocabulary (256), pre-LN blocks (causal self-attention through
`F.scaled_dot_product_attention`, then a GELU MLP), a final LayerNorm and an
output head tied to the token embedding. With the default sizes (6 layers,
width 256, 4 heads, context 128) it has about 4.8M parameters.

`forward(tokens, targets)` returns the mean cross-entropy loss, so every
system under test can treat the model as "batch in, scalar loss out".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the decoder; the defaults are the benchmark's model."""

    vocab_size: int = 256  # byte-level tokens
    block_size: int = 128  # longest sequence the position table covers
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 256
    mlp_ratio: int = 4


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(width, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, H, T, C / H)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C / H)
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    """Two linear layers with a GELU between them."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc = nn.Linear(config.n_embd, hidden)
        self.proj = nn.Linear(hidden, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only language model whose forward returns the loss."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        cfg = self.config
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.position_embedding = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_final = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: one tensor, two uses
        self.checkpoint_blocks = False  # recompute each block in backward (zeromem.checkpoint)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """tokens, targets: (B, T) int64 -> scalar mean cross-entropy."""
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)  # (T,)
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, T, C)
        for block in self.blocks:
            if self.checkpoint_blocks:
                from zeromem import checkpoint
                x = checkpoint(block, x)  # keeps only x; Pa / Pa+cpu / MD from the config
            else:
                x = block(x)
        logits = self.head(self.ln_final(x))  # (B, T, V)
        # Cross-entropy in fp32 whatever the compute dtype, so losses compare across systems.
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (the tied head counts once)."""
    return sum(p.numel() for p in model.parameters())
