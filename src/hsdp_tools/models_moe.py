"""The mixture-of-experts reference model (``bench step --arch moe``, ``hsdp sim``): Llama blocks
whose MLP is ``experts`` SwiGLU experts (grouped weights, torchtitan's ``GroupedExperts``
layout) split over ``ep`` expert-parallel ranks (docs/guide/mixture_of_experts.md).

Routing is expert choice: each expert takes the ``capacity`` tokens of this rank that score
highest for it (``top_k`` experts per token on average), so every shape is static (no
host synchronization, capturable) and the load is balanced. Expert parallelism as
torchtitan runs it: the routed tokens go to the ep rank holding their expert through an
all-to-all on the ep group (``EPExchange``; ``[ep, experts / ep, capacity, hidden]``), the
local experts run as batched matmuls, and a second all-to-all brings the outputs back
(the backward of each is the other). Under torch's fake process group an all-to-all moves
nothing: a tool gives ``EPExchange`` a ``delay`` (``bench step`` sleeps the compute stream
for the exchange's modelled time on the inner link), and the simulator drops the exchange
and prices it (``hsdp_tools.sim.ep_pricing``). Each rank holds its ``experts / ep`` experts
as DTensors on
``hsdp.expert_mesh(mesh, ep)["ep"]`` (``Shard(0)``); ``unit_meshes`` shards them as a unit
of their own on the expert mesh, nested in their block's unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import hsdp
from hsdp_tools.models import Llama, LlamaBlock, LlamaConfig, ModelConfig, build_model, shard_units

EP_KEY = "all_to_all:ep"  # the exchange's bytes in a trainee's ``collective_bytes``


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


class EPExchange:
    """The all-to-all of routed tokens over the ep ``group`` (None: one rank, nothing
    moves), each preceded by ``delay(nbytes, ranks)`` (if set: an emulation's) and its
    bytes added to ``nbytes[EP_KEY]`` (if given)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.delay: Callable[[int, int], None] | None = None
        self.nbytes: dict[str, int] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return x
        return _AllToAll.apply(x, self)

    def send(self, x: torch.Tensor) -> torch.Tensor:
        """Row r of ``x`` ([ep, ...]) to ep rank r; row r of the result from ep rank r."""
        x = x.contiguous()
        size = x.numel() * x.element_size()
        if self.nbytes is not None:
            self.nbytes[EP_KEY] = self.nbytes.get(EP_KEY, 0) + size
        if self.delay is not None:
            self.delay(size, dist.get_world_size(self.group))
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: EPExchange) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange.send(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.exchange.send(grad), None


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


def build_bench_model(cfg: ModelConfig, mesh: DeviceMesh | None) -> nn.Module:
    """``cfg``'s model on the current default device: ``hsdp_tools.models``' or, for a
    ``MoEConfig``, ``MoELlama`` with its experts as DTensors on the ep dim of ``mesh``'s
    expert mesh and the exchange on its group (``mesh`` None or ep 1: plain local experts,
    no exchange, sharded with their block)."""
    if not isinstance(cfg, MoEConfig):
        return build_model(cfg)
    model = MoELlama(cfg)
    if mesh is None or cfg.ep == 1:
        return model
    ep_mesh = hsdp.expert_mesh(mesh, cfg.ep)["ep"]
    for block in model.blocks:
        e = block.experts
        for name in ("w1", "w2", "w3"):
            local = getattr(e, name).detach()
            setattr(e, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)],
                                                             run_check=False)))
    model.exchange.group = ep_mesh.get_group()
    return model


def unit_meshes(model: nn.Module, mesh: DeviceMesh, fsdp2: bool = False
                ) -> list[tuple[nn.Module, bool, DeviceMesh]]:
    """``shard_units`` with each unit's mesh: ``mesh``, and for an MoE model with expert
    parallelism each block's experts first, on the expert mesh (FSDP2: its ("outer",
    "inner") dims)."""
    out = []
    for unit, reshard in shard_units(model):
        if isinstance(unit, MoEBlock) and unit.cfg.ep > 1:
            emesh = hsdp.expert_mesh(mesh, unit.cfg.ep)
            out.append((unit.experts, True, emesh["outer", "inner"] if fsdp2 else emesh))
        out.append((unit, reshard, mesh))
    return out


def shard_divisors(model: nn.Module, inner: int) -> list[int]:
    """Per parameter of ``model``, over how many ranks one shard of it is split: an
    expert's over the ``inner / ep`` ranks holding the same experts, any other's over
    ``inner``."""
    experts = {id(p) for m in model.modules() if isinstance(m, GroupedExperts)
               for p in m.parameters()}
    ep = getattr(model.cfg, "ep", 1)
    return [inner // ep if id(p) in experts else inner for p in model.parameters()]
