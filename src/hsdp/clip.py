"""``clip_grad_norm_``: the total gradient norm over every shard (DP, TP, EP and, given the
pipeline's group, every stage), then the clip."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.api import _root_unit
from hsdp.runtime.agreement import joined
from hsdp.runtime.step import Phase
from hsdp.runtime.unit import Unit
from hsdp.sharding.group import owner
from hsdp.sharding.tp_blocks import block_of
from hsdp.topology.communicators import comm_groups

# Process-wide: clip calls are store exchanges numbered per unit on every rank (weak).
_CLIPS: weakref.WeakKeyDictionary[Unit, itertools.count] = weakref.WeakKeyDictionary()

# (the unit mesh's shape and dims, sharded over outer, sharded over tp / ep): the same keys
# on every rank
Spread = tuple[tuple[int, ...], tuple[str, ...], bool, bool]


def _sharded_grads(model: nn.Module
                   ) -> dict[Spread, tuple[tuple[dist.ProcessGroup, ...], list[torch.Tensor]]]:
    """The local pieces of the gradients by how they are spread, with the host groups over
    which they are, each element once (``parameters()`` yields a shared parameter once; an
    empty piece's placeholder not at all, whatever in-place ops wrote into it). Every
    parameter's spread is listed, with a gradient or not, so every rank has the same keys."""
    out: dict[Spread, tuple[tuple[dist.ProcessGroup, ...], list[torch.Tensor]]] = {}
    for p in model.parameters():
        managed = owner(p)
        if managed is None:
            continue
        g = managed[0]
        split = block_of(p._spec) is not None
        key = (tuple(g.comms.mesh.mesh.shape), tuple(g.comms.mesh.mesh_dim_names),
               g.shard_outer, split)
        _, grads = out.setdefault(key, (g.comms.piece_groups(g.shard_outer, split), []))
        if p.grad is None:
            continue
        local = p.grad._local_tensor
        held = getattr(p.grad, "_hsdp_range", (0, local.numel()))[1]
        grads.append(local.reshape(-1)[:held])
    return out


class _Norm:
    """Partial norms (sums of |g|^p, or maxima for the inf-norm) and their reductions."""

    def __init__(self, norm_type: float) -> None:
        self.p = norm_type
        self.inf = norm_type == float("inf")
        self.op = dist.ReduceOp.MAX if self.inf else dist.ReduceOp.SUM

    def local(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        grads = [g for g in grads if g.numel()]  # a rank may hold none of a parameter
        if not grads:
            return torch.zeros((), device=device)
        stacked = torch.stack([n.float() for n in torch._foreach_norm(grads, self.p)])
        return stacked.max() if self.inf else stacked.pow(self.p).sum()

    def over(self, part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        dist.all_reduce(part, op=self.op, group=group)
        return part

    def over_all(self, part: torch.Tensor, groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
        for group in groups:
            self.over(part, group)
        return part

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b) if self.inf else a + b


def _stage_part(model: nn.Module, norm: _Norm) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One root's partial norm, reduced over its mesh (each element counted once), and
    its local gradient pieces."""
    unit = _root_unit(model)
    rt = unit.runtime
    if rt is not None:
        rt.settle()
    if rt is not None and (rt.step.phase is Phase.BACKWARD or rt.step.awaiting_last):
        raise RuntimeError("hsdp.clip_grad_norm_: gradients are not final yet (call it after "
                           "the last microbatch's backward)")
    spread = _sharded_grads(model)
    comms = comm_groups(unit.mesh)

    def reduce_norm() -> torch.Tensor:
        # Each part over the groups it is spread on (inner, outer, tp / ep), then added:
        # every element counted once, on every rank.
        total = torch.zeros((), device=unit.device)
        for key in sorted(spread, key=repr):
            groups, grads = spread[key]
            total = norm.add(total, norm.over_all(norm.local(grads, unit.device), groups))
        # Every rank of the mesh meets here (over outer too when no piece is spread on it,
        # as under HSDP), so that a stalled peer is named by all of them within the timeout.
        if not any(comms.host_outer in groups for groups, _ in spread.values()):
            norm.over(torch.zeros((), device=unit.device), comms.host_outer)
        return total

    step = max(rt.log.step - 1, 0) if rt is not None else 0  # the step that made the grads
    key = f"hsdp/{unit.label}/clip/{next(_CLIPS.setdefault(unit, itertools.count()))}"
    try:
        total = joined(f"clip_grad_norm_ after step {step}", key, reduce_norm, comms.timeout)
    except RuntimeError as exc:
        if rt is not None:
            rt.step.mark_broken(str(exc))
        raise
    return total, [g for _, gs in spread.values() for g in gs]


def clip_grad_norm_(model: nn.Module | Sequence[nn.Module], max_norm: float,
                    norm_type: float = 2.0, *,
                    pp_group: dist.ProcessGroup | DeviceMesh | None = None) -> torch.Tensor:
    """Clip gradients in place by their total norm over all shards (DP, TP and EP),
    counting every gradient element once (not once per outer or tp replica). Returns the total
    norm. With pipeline parallelism pass this rank's stage roots (several with an
    interleaved schedule) and ``pp_group``, the group (or 1-D mesh) of its pipeline ranks:
    the norm is then over every stage, as torchtitan's ``clip_grad_norm_(pp_mesh=...)``.
    Every rank of ``pp_group`` must call it."""
    norm = _Norm(norm_type)
    models = [model] if isinstance(model, nn.Module) else list(model)
    if not models:
        raise ValueError("hsdp.clip_grad_norm_: no model given")
    parts = [_stage_part(m, norm) for m in models]
    total = parts[0][0]
    for part, _ in parts[1:]:
        total = norm.add(total, part.to(total.device))
    if pp_group is not None:
        group = pp_group.get_group() if isinstance(pp_group, DeviceMesh) else pp_group
        total = norm.over(total, group)
    total = total if norm.inf else total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [g for _, gs in parts for g in gs]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
