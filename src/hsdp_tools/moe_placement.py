"""A mixture-of-experts model (``models_moe``) on a mesh, for the tools that train or price
it (``bench step --arch moe``, ``hsdp sim``): the model built with each rank's ``experts /
ep`` experts as DTensors on ``hsdp.expert_mesh(mesh, ep)["ep"]`` (``Shard(0)``) and the
exchange on that group; each unit's mesh (the experts a unit of their own on the expert
mesh, nested in their block's unit); over how many ranks each parameter is sharded.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import hsdp
from hsdp_tools.models import ModelConfig, build_model, shard_units
from hsdp_tools.models_moe import GroupedExperts, MoEBlock, MoEConfig, MoELlama


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
