"""A small GPT-style model for tests, the demo and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHECKPOINT_MODES = ("none", "reentrant", "non_reentrant", "unit_reentrant",
                    "unit_non_reentrant")


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 37
    hidden: int = 36
    heads: int = 3
    ffn: int = 50
    layers: int = 3
    seq: int = 8
    # Activation checkpointing: "reentrant" / "non_reentrant" inside each block's forward;
    # "unit_reentrant" / "unit_non_reentrant" around each block call (the whole unit).
    checkpoint: str = "none"

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"unknown checkpoint mode {self.checkpoint!r}")

    @property
    def num_params(self) -> int:
        h, f = self.hidden, self.ffn
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return self.vocab * h + self.seq * h + self.layers * block + 2 * h + h * self.vocab + 1


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.cfg.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.checkpoint not in ("reentrant", "non_reentrant"):
            return self._forward(x)
        return checkpoint(self._forward, x, use_reentrant=self.cfg.checkpoint == "reentrant")


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.logit_scale = nn.Parameter(torch.ones(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mode = self.cfg.checkpoint
        for blk in self.blocks:
            if mode.startswith("unit_"):
                x = checkpoint(blk, x, use_reentrant=mode == "unit_reentrant")
            else:
                x = blk(x)
        return self.head(self.ln_f(x)) * self.logit_scale


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (mean over positions)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                           tokens[:, 1:].reshape(-1))
