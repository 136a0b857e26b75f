"""Checkpoint views of a sharded model."""

from __future__ import annotations

import torch
import torch.nn as nn

from hsdp.comm import Collectives


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters under the model's own names and dtypes, on CPU, identical on
    every rank. A collective: every rank must call it. Buffers are included as they are."""
    unit = getattr(model, "_hsdp_unit", None)
    if unit is not None and unit.runtime is not None:
        if unit.runtime.phase != "idle":
            raise RuntimeError("hsdp.full_state_dict: called during forward or backward")
        unit.runtime.synchronize()
    coll = Collectives()
    flats: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        group = getattr(p, "_hsdp_group", None)
        if group is None:
            out[name] = p.detach().cpu().clone()
            continue
        if id(group) not in flats:
            flats[id(group)] = group.full_flat(coll)
        idx = next(i for i, sp in enumerate(group.sharded) if sp is p)
        off, shape = group.layout.offsets[idx], group.layout.shapes[idx]
        n = group.unsharded[idx].numel()
        out[name] = flats[id(group)][off:off + n].view(shape).cpu().clone()
    for name, b in model.named_buffers():
        out[name] = b.detach().cpu().clone()
    return out
