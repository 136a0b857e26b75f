"""Full (unsharded) state dicts of a sharded model: export and initialization."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.runtime.step import Phase
from hsdp.sharding.comm import Collectives
from hsdp.sharding.group import ParamGroup, owner
from hsdp.topology.communicators import host_group


def quiesce(model: nn.Module, what: str) -> None:
    """Wait for every stream (after abandoning a step that raised: see
    docs/guide/failure_semantics.md); refuse during forward / backward."""
    unit = getattr(model, "_hsdp_unit", None)
    if unit is not None and unit.runtime is not None:
        unit.runtime.synchronize()
        if unit.runtime.step.phase is not Phase.IDLE:
            raise RuntimeError(f"hsdp.{what}: called during forward or backward")


_COMPILED = "_orig_mod."  # torch.compile(module)'s wrapper inserts it into the keys


def clean_key(key: str) -> str:
    """``key`` without the ``_orig_mod.`` of ``torch.compile`` wrappers (as torch's
    ``get_model_state_dict`` names it), so compiled and plain models share their keys."""
    return key.replace(_COMPILED, "")


def clean_keys(state: dict[str, Any]) -> dict[str, Any]:
    return {clean_key(k): v for k, v in state.items()}


def model_keys(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (clean keys, or the model's own) under the model's own state-dict keys,
    for ``model.load_state_dict``."""
    own = {clean_key(k): k for k in model.state_dict(keep_vars=True)}
    return {own.get(clean_key(k), k): v for k, v in state.items()}


def _entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict keys (tied parameters under every name, persistent buffers;
    see ``clean_key``) with the live parameters / buffers."""
    return clean_keys(model.state_dict(keep_vars=True))


def full_state_dict(model: nn.Module, *, rank0_only: bool = False,
                    cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded parameters and buffers under the model's own state-dict keys (tied
    parameters under each of their names) and dtypes. A collective: every rank must call
    it. Gathers one parameter group at a time, so besides the result a rank holds at most
    one group's (<= one unit's) full parameters. ``rank0_only``: only rank 0 keeps the
    tensors, the others return ``{}``. ``cpu_offload``: results on CPU (else on the
    model's device). Buffers (e.g. BatchNorm statistics, which each rank updates from its
    own batches) are rank 0's on every rank, as DDP broadcasts them."""
    quiesce(model, "full_state_dict")
    keep = not rank0_only or dist.get_rank() == 0
    entries = _entries(model)
    groups: dict[ParamGroup, list[tuple[str, int]]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, t in entries.items():
        managed = owner(t)
        if managed is not None:
            groups.setdefault(managed[0], []).append((key, managed[1]))
        elif keep:
            out[key] = _keep(t.detach(), cpu_offload)
    coll = Collectives()
    for group, members in groups.items():
        flat = group.full_flat(coll)
        for key, idx in members:
            whole = group.whole(flat, idx)  # a collective over tp where TP shards it
            if keep:
                out[key] = _keep(whole, cpu_offload)
            del whole  # a view of flat: it would keep flat alive into the next group
        del flat  # before the next group's is gathered
    if not rank0_only:
        for key, t in entries.items():
            if owner(t) is None and not isinstance(t, nn.Parameter):
                cpu = out[key].cpu()
                dist.broadcast(cpu, src=0, group=host_group())
                out[key] = cpu if cpu_offload else cpu.to(t.device)
    return {k: out[k] for k in entries if k in out}


def _keep(t: torch.Tensor, cpu_offload: bool) -> torch.Tensor:
    return t.to("cpu", copy=True) if cpu_offload else t.clone()


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None, *,
                         from_rank0: bool = False) -> None:
    """Load unsharded tensors (``full_state_dict``'s, or a plain model's ``state_dict()``)
    into the shards. Keys and shapes must match (of tied parameters one name suffices);
    a mismatch raises before anything is written. Every rank passes the same ``state``,
    or with ``from_rank0=True`` only rank 0 does (the others may pass None) and each
    tensor is broadcast from it over the mesh (a collective)."""
    quiesce(model, "load_full_state_dict")
    entries = _entries(model)
    state = None if state is None else clean_keys(state)
    error, present = None, None
    if not from_rank0 or dist.get_rank() == 0:
        error = _mismatch(entries, state or {})
        present = [k for k in entries if k in (state or {})]
    if from_rank0:  # every rank raises the same error, or none does
        verdict = [error, present]
        dist.broadcast_object_list(verdict, src=0, group=host_group())
        error, present = verdict
    if error is not None:
        raise error
    mesh = _mesh(model)
    done: set[int] = set()
    for key in present:
        t = entries[key]
        if id(t) in done:  # a tied parameter's alias
            continue
        done.add(id(t))
        full = _broadcast(state[key] if dist.get_rank() == 0 else None, t, mesh) \
            if from_rank0 else state[key]
        managed = owner(t)
        if managed is None:
            t.copy_(full)
            continue
        q = managed[0].params[managed[1]]
        # In place: hfsdp sees the version bump and re-gathers its inner shard.
        q.local.copy_(q.piece_of(full))


def _mismatch(entries: dict[str, torch.Tensor],
              state: dict[str, torch.Tensor]) -> Exception | None:
    """The first mismatch between the model's entries and ``state``, as an exception."""
    covered = {id(t) for k, t in entries.items() if k in state}
    missing = sorted(k for k, t in entries.items() if id(t) not in covered)
    unexpected = sorted(set(state) - set(entries))
    if missing or unexpected:
        return KeyError(f"hsdp.load_full_state_dict: missing keys {missing}, unexpected keys "
                        f"{unexpected}")
    for key, t in entries.items():
        if key in state and tuple(state[key].shape) != tuple(t.shape):
            return ValueError(f"hsdp.load_full_state_dict: {key} has shape "
                              f"{tuple(state[key].shape)}, the model's is {tuple(t.shape)}")
    return None


def _mesh(model: nn.Module) -> DeviceMesh | None:
    unit = getattr(model, "_hsdp_unit", None)
    return None if unit is None else unit.mesh


def _broadcast(full: torch.Tensor | None, like: torch.Tensor,
               mesh: DeviceMesh | None) -> torch.Tensor:
    """Rank 0's tensor on every rank: along outer (to the ranks whose later coordinates
    are 0), then along inner, then along tp; on the mesh's device groups."""
    device = like._local_tensor.device if hasattr(like, "_local_tensor") else like.device
    out = (full.to(device=device, dtype=like.dtype) if dist.get_rank() == 0
           else torch.empty(like.shape, dtype=like.dtype, device=device))
    if mesh is None:
        dist.broadcast(out, src=0)
        return out
    coords = mesh.get_coordinate()
    for k, dim in enumerate(mesh.mesh_dim_names):
        if any(coords[k + 1:]):
            continue  # gets it from the rank whose later coordinates are 0, later
        group = mesh.get_group(dim)
        dist.broadcast(out, src=dist.get_global_rank(group, 0), group=group)
    return out

