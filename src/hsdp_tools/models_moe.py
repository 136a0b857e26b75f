"""The mixture-of-experts reference model (``bench step --arch moe``, ``hsdp sim``): Llama blocks
whose MLP is ``experts`` SwiGLU experts (grouped weights, torchtitan's ``GroupedExperts``
layout) split over ``ep`` expert-parallel ranks (docs/guide/mixture_of_experts.md).

Routing is expert choice: each expert takes the ``capacity`` tokens of this rank that score
highest for it (``top_k`` experts per token on average), so every shape is static (no
host synchronization, capturable) and the load is balanced. Expert parallelism as
torchtitan runs it: the routed tokens go to the ep rank holding their expert through an
all-to-all on the ep group (``moe_exchange.EPExchange``; ``[ep, experts / ep, capacity,
hidden]``), the local experts run as batched matmuls, and a second all-to-all brings the
outputs back. Each rank holds its ``experts / ep`` experts; ``moe_placement`` builds the
model with them as DTensors on the expert mesh and gives each unit its mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hsdp_tools.models import Llama, LlamaBlock, LlamaConfig
from hsdp_tools.moe_exchange import EPExchange


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """``LlamaConfig`` with ``experts`` SwiGLU experts of width ``ffn`` per block, ``top_k``
    of them per token on average, split over ``ep`` expert-parallel ranks."""

    experts: int = 8
    top_k: int = 2
    ep: int = 1
    arch: str = field(default="moe", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.experts, self.top_k, self.ep) < 1 or self.experts % self.ep:
            raise ValueError(f"moe: experts={self.experts} must be a multiple of ep={self.ep} "
                             f"(both >= 1)")
        if self.top_k > self.experts:
            raise ValueError(f"moe: top_k={self.top_k} exceeds experts={self.experts}")

    @property
    def block_params(self) -> int:
        h = self.hidden
        return (2 * h + 2 * h * h + 2 * h * self.kv_dim + h * self.experts
                + 3 * self.experts * h * self.ffn)

    def capacity(self, tokens: int) -> int:
        """Tokens each expert takes of ``tokens`` routed on one rank."""
        return math.ceil(tokens * self.top_k / self.experts)

    def exchange_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """The buffer one all-to-all sends (all of this rank's routed tokens)."""
        return self.experts * self.capacity(tokens) * self.hidden * dtype_bytes


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts as three batched weights ([n, hidden, ffn] and [n, ffn,
    hidden])."""

    def __init__(self, n: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, hidden, ffn) * hidden ** -0.5)  # gate
        self.w3 = nn.Parameter(torch.randn(n, hidden, ffn) * hidden ** -0.5)  # up
        self.w2 = nn.Parameter(torch.randn(n, ffn, hidden) * ffn ** -0.5)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, tokens, hidden] through expert i for row i."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1, self.w2, self.w3))
        return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


class MoEBlock(LlamaBlock):
    """A Llama block whose MLP is a router and this rank's experts (module docstring)."""

    exchange: EPExchange

    def _init_mlp(self, cfg: MoEConfig) -> None:
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = GroupedExperts(cfg.experts // cfg.ep, cfg.hidden, cfg.ffn)

    def _mlp(self, y: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        flat = y.reshape(-1, cfg.hidden)
        local, cap = cfg.experts // cfg.ep, cfg.capacity(flat.shape[0])
        scores = torch.softmax(self.router(flat).float(), dim=-1)
        gates, picked = scores.t().topk(cap, dim=-1)  # [experts, cap]: each expert's tokens
        routed = flat.index_select(0, picked.reshape(-1)).view(cfg.ep, local, cap, -1)
        mine = self.exchange(routed).transpose(0, 1).reshape(local, cfg.ep * cap, -1)
        out = self.experts(mine).view(local, cfg.ep, cap, -1).transpose(0, 1)
        back = self.exchange(out).reshape(cfg.experts * cap, -1)
        weighted = back * gates.reshape(-1, 1).to(back.dtype)
        return torch.zeros_like(flat).index_add_(0, picked.reshape(-1), weighted).view_as(y)


class MoELlama(Llama):
    """Llama with ``MoEBlock``s sharing one ``EPExchange`` (``exchange``)."""

    block_class = MoEBlock

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.exchange = EPExchange()
        for block in self.blocks:
            block.exchange = self.exchange
