"""Mixture-of-experts with expert parallelism inside hsdp units: a tiny MoE model whose
experts are DTensors on ``hsdp.expert_mesh(mesh, ep)["ep"]`` (``Shard(0)``), sharded by
``fully_shard(block.experts, mesh=expert mesh)`` nested in ``fully_shard(block, mesh)``,
against one process and against FSDP2 on the same meshes.

The model routes every token to every expert (soft routing: gates from a softmax), so
that one process computes exactly what the ranks compute. Expert parallelism as torchtitan
does it, with collectives gloo has: the ep ranks gather each other's tokens, each applies
its experts, and the partial outputs are summed back to the tokens' ranks (the backward of
each is the other). Data: DP rank r (of all ranks) takes rows [r*b, (r+1)*b) of each
global batch; its loss is the mean over its rows, so the mean over the DP ranks of the
gradients is the reference's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

import hsdp

DIM, HIDDEN, EXPERTS, BLOCKS = 8, 12, 4, 2
ROWS = 16  # global batch: every world up to 16 gets whole rows
STEPS, LR, MOMENTUM = 3, 0.1, 0.9
CLIP = 0.05  # below the gradient norms of these runs: clipping is active


class _EpGather(torch.autograd.Function):
    """All ep ranks' tokens on every ep rank (backward: each token's gradient summed over
    the ep ranks, back on its own rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_own(grad, ctx.group), None


class _EpReduce(torch.autograd.Function):
    """Partial outputs for every ep rank's tokens summed, each rank keeping its own
    (backward: every rank's output gradients on every rank)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_own(y, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.group), None


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_zeros(dist.get_world_size(group), *x.shape)
    out[dist.get_rank(group)] = x
    dist.all_reduce(out, group=group)
    return out.flatten(0, 1)


def _reduce_own(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    y = y.contiguous().clone()
    dist.all_reduce(y, group=group)
    return y.view(dist.get_world_size(group), -1, *y.shape[1:])[dist.get_rank(group)]


class Experts(nn.Module):
    """EXPERTS two-layer experts as grouped weights (torchtitan's GroupedExperts layout);
    under expert parallelism DTensors on the ep mesh holding this rank's experts."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / DIM ** 0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if not isinstance(w1, DTensor):
            return torch.einsum("te,etd->td", gates, self._ffn(w1, w2, x))
        group = w1.device_mesh.get_group()
        n = w1.to_local().shape[0]
        first = dist.get_rank(group) * n
        x_all = _EpGather.apply(x, group)
        gates_all = _EpGather.apply(gates, group)[:, first:first + n]
        y = torch.einsum("te,etd->td", gates_all, self._ffn(w1.to_local(), w2.to_local(),
                                                               x_all))
        return _EpReduce.apply(y, group)

    @staticmethod
    def _ffn(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("edh,eth->etd", w2, F.silu(torch.einsum("ehd,td->eth", w1, x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()
        self.checkpointed = False  # activation checkpointing of the whole block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.mix(x))
        return h + self.experts(h, torch.softmax(self.router(h), dim=-1))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).squeeze(-1)


def reference() -> MoE:
    torch.manual_seed(0)
    return MoE()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, generator=g)


def distribute_experts(model: MoE, ep_mesh: DeviceMesh) -> None:
    """Each expert weight as a DTensor on ``ep_mesh`` holding this rank's experts."""
    for block in model.blocks:
        e = block.experts
        for name in ("w1", "w2"):
            full = getattr(e, name).detach()
            n = full.shape[0] // ep_mesh.size()
            local = full[ep_mesh.get_local_rank() * n:][:n].clone()
            setattr(e, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)],
                                                             run_check=False)))


def hsdp_model(mesh: DeviceMesh, ep: int, strategy: str = "hsdp", ac: bool = False,
               **kw) -> MoE:
    """The reference's weights, experts on the expert mesh, hsdp units per block with the
    experts nested."""
    model = reference()
    emesh = hsdp.expert_mesh(mesh, ep)
    distribute_experts(model, emesh["ep"])
    for block in model.blocks:
        block.checkpointed = ac
        hsdp.fully_shard(block.experts, mesh=emesh, strategy=strategy, **kw)
        hsdp.fully_shard(block, mesh=mesh, strategy=strategy, **kw)
    return hsdp.fully_shard(model, mesh=mesh, strategy=strategy, **kw)


def fsdp2_model(mesh: DeviceMesh, ep: int, **kw) -> MoE:
    """FSDP2 HSDP on the same meshes: the experts on the expert mesh's (outer, inner) of
    this rank's ep index, their mean over all DP ranks by a divide factor."""
    model = reference()
    emesh = hsdp.expert_mesh(mesh, ep)
    distribute_experts(model, emesh["ep"])
    for block in model.blocks:
        fsdp2_shard(block.experts, mesh=emesh["outer", "inner"], **kw)
        block.experts.set_gradient_divide_factor(float(mesh.size()))
        fsdp2_shard(block, mesh=mesh, **kw)
    fsdp2_shard(model, mesh=mesh, **kw)
    for m in model.modules():  # gloo has no PREMUL_SUM
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


def train(model: nn.Module, rows: slice, clip, microbatches: int = 1,
          steps: int = STEPS) -> list[float]:
    """``steps`` SGD steps on ``rows`` of each batch; the gradient norms ``clip`` returned."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    norms = []
    for step in range(steps):
        x, y = _batch(step)
        x, y = x[rows], y[rows]
        for mb, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
            loss = F.mse_loss(model(xm).float(), ym) / microbatches
            if hasattr(model, "_hsdp_unit"):
                with hsdp.microbatch(model, is_last=mb == microbatches - 1):
                    loss.backward()
            else:
                loss.backward()
        norms.append(float(clip(model)))
        opt.step()
        opt.zero_grad()
    return norms


@torch.no_grad()
def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def _one_process_clip(model: nn.Module) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)


def _hsdp_clip(model: nn.Module) -> torch.Tensor:
    return hsdp.clip_grad_norm_(model, CLIP)


def _per_mesh_clip(model: nn.Module) -> torch.Tensor:
    """torchtitan's clip with expert parallelism: the parameters live on two meshes (torch's
    ``clip_grad_norm_`` refuses to stack their norms, under FSDP2 as under hsdp): the norm
    over each, then their sum."""
    parts: dict[int, list[nn.Parameter]] = {}
    for p in model.parameters():
        parts.setdefault(p.device_mesh.ndim, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor()
             for ps in parts.values()]
    total = torch.stack(norms).pow(2).sum().sqrt()
    for ps in parts.values():
        torch.nn.utils.clip_grads_with_norm_(ps, CLIP, total)
    return total


def parity_job(rank: int, world: int, path: str) -> dict[str, float | bool | list]:
    """Relative parameter error after ``STEPS`` steps on the (2, world/2) mesh with ep 2
    (and 4): hsdp (both strategies, microbatches, activation checkpointing, its clip and
    torchtitan's) against one process and against FSDP2 (ep 2); the gradient norms against
    one process's; a DCP checkpoint of the ep 2 model loaded on ep 4 (equal) and on ep 2
    resumed (bit for bit)."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    ref = reference()
    ref_norms = train(ref, slice(None), _one_process_clip)
    want = full_params(ref)
    out: dict[str, float | bool | list] = {"mesh": hsdp.expert_mesh(mesh, 2).mesh.tolist()}
    fsdp2 = fsdp2_model(mesh, 2)
    out["fsdp2 norms"] = train(fsdp2, rows, _per_mesh_clip)
    fsdp2_params = full_params(fsdp2)
    out["fsdp2 vs ref"] = rel(fsdp2_params, want)
    # ep 4: one rank per expert inner group (the experts replicated over outer only);
    # ep 1: every expert on every rank, sharded over the whole inner group
    for strategy, ep, mb, clip, ac in (("hsdp", 2, 1, _hsdp_clip, False),
                                       ("hfsdp", 2, 2, _per_mesh_clip, True),
                                       ("hsdp", 4, 1, _hsdp_clip, False),
                                       ("hsdp", 1, 1, _hsdp_clip, False)):
        model = hsdp_model(mesh, ep, strategy, ac)
        name = f"{strategy} ep={ep} mb={mb} ac={ac} {clip.__name__}"
        out[f"{name} norms"] = train(model, rows, clip, mb)
        got = full_params(model)
        out[f"{name} vs ref"] = rel(got, want)
        out[f"{name} vs fsdp2"] = rel(got, fsdp2_params)
        hsdp.synchronize(model)
    # bf16 parameters for compute, fp32 reductions: against FSDP2 with the same policy
    fsdp2 = fsdp2_model(mesh, 2, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    train(fsdp2, rows, _per_mesh_clip)
    model = hsdp_model(mesh, 2, mp_policy=hsdp.MixedPrecision(torch.bfloat16, torch.float32))
    train(model, rows, _hsdp_clip)
    out["bf16 hsdp vs fsdp2"] = rel(full_params(model), full_params(fsdp2))
    out["bf16 fsdp2 vs ref"] = rel(full_params(fsdp2), want)
    hsdp.synchronize(model)
    out["ref norms"] = ref_norms
    out.update(_checkpoint(mesh, rows, path))
    out["errors"] = _errors(mesh)
    return out


def _errors(mesh: DeviceMesh) -> list[str]:
    """What is refused, before anything is sharded: an ep that does not divide inner, a
    plain parameter on the expert mesh, the experts of a DiLoCo mesh (last: the mesh's
    groups keep DiLoCo's schedule)."""
    out = []
    for build in (lambda: hsdp.expert_mesh(mesh, 3),
                  lambda: hsdp.fully_shard(nn.Linear(2, 2), mesh=hsdp.expert_mesh(mesh, 2)),
                  lambda: hsdp.expert_mesh(hsdp.init_mesh(
                      2, mesh.size() // 2, "cpu", outer_sync=hsdp.DiLoCo(inner_steps=2)), 2)):
        try:
            build()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


def _checkpoint(mesh: DeviceMesh, rows: slice, path: str) -> dict[str, bool | float]:
    model = hsdp_model(mesh, 2)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(2):
        x, y = _batch(step)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        hsdp.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
    hsdp.save(path, model, opt)
    saved = full_params(model)
    out: dict[str, bool | float] = {}
    for ep in (4, 2):
        other = hsdp_model(mesh, ep)
        other_opt = torch.optim.SGD(other.parameters(), lr=LR, momentum=MOMENTUM)
        hsdp.load(path, other, other_opt)
        out[f"ep=2 ckpt -> ep={ep} equal"] = all(
            torch.equal(a, b) for a, b in zip(full_params(other).values(), saved.values()))
        for m, o in ((model, opt), (other, other_opt)) if ep == 2 else ():
            x, y = _batch(2)
            F.mse_loss(m(x[rows]), y[rows]).backward()
            hsdp.clip_grad_norm_(m, CLIP)
            o.step()
            o.zero_grad()
        if ep == 2:
            out["resume bit for bit"] = all(torch.equal(a, b) for a, b in zip(
                full_params(other).values(), full_params(model).values()))
        hsdp.synchronize(other)
    hsdp.synchronize(model)
    return out
