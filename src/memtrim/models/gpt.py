"""A small GPT-style decoder: pre-LayerNorm blocks, causal ``scaled_dot_product_attention``, GELU MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidInputError

__all__ = ["GPTConfig", "SmallGPT"]


@dataclass(frozen=True)
class GPTConfig:
    """Size of a :class:`SmallGPT`. ``d_model`` must be divisible by ``n_head``."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    d_model: int = 128
    n_head: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"memtrim.models.GPTConfig: {name} must be >= 1, got {getattr(self, name)}.")
        if self.d_model % self.n_head:
            raise InvalidInputError(
                f"memtrim.models.GPTConfig: d_model ({self.d_model}) must be divisible by n_head ({self.n_head})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidInputError(f"memtrim.models.GPTConfig: dropout must be in [0, 1), got {self.dropout}.")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class SmallGPT(nn.Module):
    """Token + position embeddings, ``n_layer`` pre-LN blocks, final LayerNorm, untied LM head.

    ``forward(idx)`` takes token ids ``(B, T)`` with ``T <= seq_len`` and returns logits ``(B, T, vocab)``;
    train with ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())``.
    """

    def __init__(self, config: GPTConfig | None = None, **overrides: int | float) -> None:
        super().__init__()
        config = config or GPTConfig(**overrides)  # type: ignore[arg-type]
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``(B, T, config.vocab_size)`` for token ids ``(B, T)``, ``T <= config.seq_len``."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise InvalidInputError(
                f"SmallGPT.forward: sequence length {t} exceeds config.seq_len {self.config.seq_len}."
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
