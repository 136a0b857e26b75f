"""Checkpoint views of a sharded model."""

from __future__ import annotations

import torch
import torch.nn as nn

from hsdp.comm import Collectives
from hsdp.group import owner


def _quiesce(model: nn.Module, what: str) -> None:
    """Wait for every stream; refuse during forward / backward."""
    unit = getattr(model, "_hsdp_unit", None)
    if unit is not None and unit.runtime is not None:
        if unit.runtime.phase != "idle":
            raise RuntimeError(f"hsdp.{what}: called during forward or backward")
        unit.runtime.synchronize()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters under the model's own names and dtypes, on CPU, identical on
    every rank. A collective: every rank must call it. Buffers are included as they are."""
    _quiesce(model, "full_state_dict")
    coll = Collectives()
    flats: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        managed = owner(p)
        if managed is None:
            out[name] = p.detach().cpu().clone()
            continue
        group, idx = managed
        if id(group) not in flats:
            flats[id(group)] = group.full_flat(coll)
        off, shape = group.layout.offsets[idx], group.layout.shapes[idx]
        n = group.unsharded[idx].numel()
        out[name] = flats[id(group)][off:off + n].view(shape).cpu().clone()
    for name, b in model.named_buffers():
        out[name] = b.detach().cpu().clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load unsharded tensors (as ``full_state_dict`` returns them) into the shards. Every
    rank passes the same full state; no communication. Keys and shapes must match."""
    _quiesce(model, "load_full_state_dict")
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise KeyError(f"hsdp.load_full_state_dict: missing keys {missing}, unexpected keys "
                       f"{unexpected}")
    for name, t in own.items():
        managed = owner(t)
        full = state[name]
        if managed is None:
            t.copy_(full)
            continue
        group, idx = managed
        if tuple(full.shape) != group.layout.shapes[idx]:
            raise ValueError(f"hsdp.load_full_state_dict: {name} has shape "
                             f"{tuple(full.shape)}, the model's is {group.layout.shapes[idx]}")
        start, local = group.shard_starts[idx], group.local(idx)
        # In place: hfsdp sees the version bump and re-gathers its inner shard.
        local.copy_(full.reshape(-1)[start:start + local.numel()])
