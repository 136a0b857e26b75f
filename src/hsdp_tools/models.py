"""The model zoo shared by tests, the demo, ``bench`` and ``sim``: a small GPT and a
Llama-style transformer (RMSNorm, grouped-query attention with RoPE, SwiGLU), with named
sizes (``PRESETS``).

Both models have the same outline, which ``bench`` and ``sim`` rely on: ``model.embed``,
``model.blocks`` (an ``nn.ModuleList``), ``model.head`` and a root that owns the rest (final
norm; GPT's positions). ``shard_units`` says how they are sharded. ``build_model(cfg)``
builds either from its config, also on the meta device (``with torch.device("meta"):``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Activation checkpointing: "reentrant" / "non_reentrant" inside each block's forward;
# "unit_reentrant" / "unit_non_reentrant" around each block call (the whole unit).
CHECKPOINT_MODES = ("none", "reentrant", "non_reentrant", "unit_reentrant",
                    "unit_non_reentrant")


def _check(cfg: GPTConfig | LlamaConfig) -> None:
    if cfg.hidden % cfg.heads:
        raise ValueError(f"hidden={cfg.hidden} is not divisible by heads={cfg.heads}")
    if cfg.checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"unknown checkpoint mode {cfg.checkpoint!r}")


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 style: LayerNorm, biased linears, learned positions, GELU MLP."""

    vocab: int = 37
    hidden: int = 36
    heads: int = 3
    ffn: int = 50
    layers: int = 3
    seq: int = 8
    checkpoint: str = "none"
    arch: str = field(default="gpt", init=False)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def block_params(self) -> int:
        h, f = self.hidden, self.ffn
        return 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)

    @property
    def num_params(self) -> int:
        h = self.hidden
        root = self.vocab * h + self.seq * h + 2 * h + h * self.vocab + 1
        return root + self.layers * self.block_params


@dataclass(frozen=True)
class LlamaConfig:
    """Llama style: RMSNorm, no biases, RoPE, grouped-query attention (``kv_heads`` key /
    value heads shared by ``heads / kv_heads`` query heads each), SwiGLU MLP of width
    ``ffn``, untied embedding and head."""

    vocab: int = 37
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 48
    layers: int = 3
    seq: int = 8
    checkpoint: str = "none"
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    arch: str = field(default="llama", init=False)

    def __post_init__(self) -> None:
        _check(self)
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"head dim {self.hidden // self.heads} must be even (RoPE)")

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def block_params(self) -> int:
        h = self.hidden
        return 2 * h + 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.ffn

    @property
    def num_params(self) -> int:
        return 2 * self.vocab * self.hidden + self.hidden + self.layers * self.block_params


ModelConfig = GPTConfig | LlamaConfig

# Named sizes. "gpt": bench step's GPU model until now (Llama-8B-sized layers without SwiGLU
# or GQA); "gpt-1b": the model of docs/sim_vs_measured.md's emulated runs.
PRESETS: dict[str, ModelConfig] = {
    "gpt": GPTConfig(vocab=32768, hidden=4096, heads=32, ffn=14336, layers=8, seq=2048),
    "gpt-1b": GPTConfig(vocab=32000, hidden=2048, heads=16, ffn=8192, layers=16, seq=4096),
    "llama-8b": LlamaConfig(vocab=128256, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                            layers=32, seq=8192),
    "llama-70b": LlamaConfig(vocab=128256, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                             layers=80, seq=8192),
}


def preset(name: str, **overrides) -> ModelConfig:
    """``PRESETS[name]`` with some fields replaced (e.g. ``layers=8, seq=4096``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def config_from_dict(d: dict) -> ModelConfig:
    """The config ``dataclasses.asdict`` wrote (extra keys ignored; no ``arch``: GPT)."""
    cls = LlamaConfig if d.get("arch", "gpt") == "llama" else GPTConfig
    return cls(**{f.name: d[f.name] for f in fields(cls) if f.init and f.name in d})


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model of ``cfg`` (on the current default device)."""
    return GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)


def shard_units(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """The units to shard before the root, in forward order, each with its
    ``reshard_after_forward`` (torchtitan's layout): the embedding, every block, and the
    output head, kept gathered after its forward since its backward comes next. With the
    embedding and head in the root, the root's backward (first to start, last to finish)
    would reduce them both at the step's end; as units, the head's reduction hides behind
    the blocks' backward."""
    return [(model.embed, True), *((b, True) for b in model.blocks), (model.head, False)]


# --------------------------------------------------------------------------- common


class _Block(nn.Module):
    """A transformer block whose ``_forward`` runs under the config's in-block checkpoint
    mode, if any."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.checkpoint not in ("reentrant", "non_reentrant"):
            return self._forward(x)
        return checkpoint(self._forward, x, use_reentrant=self.cfg.checkpoint == "reentrant")


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor, mode: str) -> torch.Tensor:
    for blk in blocks:
        if mode.startswith("unit_"):
            x = checkpoint(blk, x, use_reentrant=mode == "unit_reentrant")
        else:
            x = blk(x)
    return x


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of [batch, heads, seq, head_dim] tensors. On the meta device (the
    simulator), as the fused flash kernel a GPU runs: one op forward, one backward, with
    their FLOP formulas, not the math decomposition the meta device would otherwise pick
    (and that, unlike torch's function modes, also holds when checkpointing recomputes)."""
    if q.is_meta:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (mean over positions)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                           tokens[:, 1:].reshape(-1))


# --------------------------------------------------------------------------- GPT


class Block(_Block):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.cfg.heads, -1).unbind(2)
        a = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


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
        x = _run_blocks(self.blocks, x, self.cfg.checkpoint)
        return self.head(self.ln_f(x)) * self.logit_scale


# --------------------------------------------------------------------------- Llama


def _rope_tables(t: int, d: int, theta: float, like: torch.Tensor) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
    """cos and sin [t, d] of the rotary embedding (rotate-half form)."""
    inv_freq = theta ** (-torch.arange(0, d, 2, device=like.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(t, device=like.device, dtype=torch.float32), inv_freq)
    return (torch.cat([angles.cos()] * 2, dim=-1).to(like.dtype),
            torch.cat([angles.sin()] * 2, dim=-1).to(like.dtype))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [batch, heads, seq, head_dim]."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    """[batch, kv_heads, seq, d] -> [batch, kv_heads * times, seq, d], each head repeated
    ``times`` times in place (grouped-query attention), so that attention runs the fused
    kernels of equal head counts."""
    if times == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, times, t, d).reshape(b, h * times, t, d)


class LlamaBlock(_Block):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        h = cfg.hidden
        self.attn_norm = nn.RMSNorm(h, eps=cfg.norm_eps)
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(h, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=cfg.norm_eps)
        self._init_mlp(cfg)
        self._rope_cache: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    def _init_mlp(self, cfg: LlamaConfig) -> None:
        """The SwiGLU MLP's weights (a mixture of experts replaces them: ``_mlp`` too)."""
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)  # down

    def _mlp(self, y: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(y)) * self.w3(y))

    def _rope_for(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables for ``x``'s length, device and dtype (made once, then kept)."""
        key = (x.shape[-2], x.device, x.dtype)
        if self._rope_cache is None or self._rope_cache[0] != key:
            self._rope_cache = (key, *_rope_tables(x.shape[-2], x.shape[-1],
                                                   self.cfg.rope_theta, x))
        return self._rope_cache[1], self._rope_cache[2]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        y = self.attn_norm(x)
        # heads from the head dim: under tensor parallelism each rank holds heads / tp of
        # them, and y the whole sequence while x holds a sequence shard
        b, t, d = y.shape[0], y.shape[1], cfg.hidden // cfg.heads
        q = self.wq(y).view(b, t, -1, d).transpose(1, 2)
        k = self.wk(y).view(b, t, -1, d).transpose(1, 2)
        v = self.wv(y).view(b, t, -1, d).transpose(1, 2)
        cos, sin = self._rope_for(q)
        group = cfg.heads // cfg.kv_heads
        q, k = _rope(q, cos, sin), repeat_kv(_rope(k, cos, sin), group)
        a = attention(q, k, repeat_kv(v, group))
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        return x + self._mlp(self.mlp_norm(x))


class Llama(nn.Module):
    block_class: type[LlamaBlock] = LlamaBlock

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(self.block_class(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = _run_blocks(self.blocks, self.embed(tokens), self.cfg.checkpoint)
        return self.head(self.norm(x))
