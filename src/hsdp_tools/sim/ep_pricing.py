"""Mixture of experts in ``hsdp sim``: the model of ``bench step --arch moe``
(``hsdp_tools.models_moe``) on the meta device, its expert units on the expert mesh, and the
expert-parallel token exchange priced as compute-stream work.

The expert units' own collectives need nothing here: they go through the root's
collectives like every unit's, with their own groups' sizes (``hsdp.expert_mesh``: ep 8
of inner 8 leaves one rank per expert inner group, so no all-gather or reduce-scatter,
and the outer reduction over the outer group), and the fabric prices each on its group.

The exchange (two all-to-alls per MoE block in the forward, a recompute included, and two
in the backward, each of ``MoEConfig.exchange_bytes``) moves nothing on the meta device;
it blocks compute while it runs (torchtitan issues it on the compute stream), so each is
priced on the fabric's inner link over the ``ep`` ranks of a node and spread over the
block's compute ops, as ``hsdp_tools.sim.tp_pricing`` spreads the TP collectives.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp_tools.models import ModelConfig
from hsdp_tools.models_moe import MoEBlock, MoEConfig
from hsdp_tools.moe_placement import build_bench_model
from hsdp_tools.sim.clock import Program, ProgramOp
from hsdp_tools.sim.costs import Price
from hsdp_tools.sim.fabric import Fabric, Link
from hsdp_tools.sim.tp_pricing import spread_over_phases

EXCHANGES = {"FWD": 2, "RECOMPUTE": 2, "BWD": 2}  # all-to-alls per MoE block phase


def sim_model(cfg: ModelConfig, mesh: DeviceMesh) -> nn.Module:
    """``cfg``'s model as ``bench step`` builds it, its exchange moving nothing (priced by
    ``ep_pricer`` instead)."""
    model = build_bench_model(cfg, mesh)
    if isinstance(cfg, MoEConfig):
        model.exchange.group = None
    return model


def expert_names(model: nn.Module) -> dict[str, str]:
    """Stable names of the expert units' labels: Experts<i> of block i."""
    return {b.experts._hsdp_unit.label: f"Experts{i}" for i, b in enumerate(model.blocks)
            if isinstance(b, MoEBlock) and b.cfg.ep > 1}


def ep_pricer(price: Price, program: Program, model: MoEConfig, mbs: int, dtype_bytes: int,
              link: Link) -> Price:
    """``price`` with the token exchange of each MoE block phase on ``link`` (module
    docstring)."""
    nbytes = model.exchange_bytes(mbs * model.seq, dtype_bytes)
    one = Fabric(link, link).seconds("all_to_all", "inner", nbytes, model.ep)
    extra = spread_over_phases(program, {f"{kind}:{MoEBlock.__name__}": n * one
                                         for kind, n in EXCHANGES.items()})

    def priced(op: ProgramOp) -> tuple[float, ...]:
        if op.kind != "compute":
            return price(op)
        host, device, *rest = price(op)
        return (host, device + extra.get(id(op), 0.0), *rest)

    return priced
