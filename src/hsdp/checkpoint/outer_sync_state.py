"""DiLoCo's outer state in checkpoints: each group's fp32 anchor, outer momentum and step
count (``sharding/anchor.py``).

The anchor lies like its group's inner shard and is the same on every outer replica, so it
is saved in the optimizer's state dict under ``KEY`` as plain tensors keyed by unit, group,
mesh shape and this rank's inner (and tp) coordinates ("blocks.0/0@4x2x1:1-0/anchor"):
the outer replicas write the same key with the same values, which DCP stores once.
Between syncs the replicas' parameters and inner optimizer state differ, while their
DTensors (replicated over outer) are stored once: each rank also saves its own shard of
them under the same key, with its outer coordinate ("/replica1/main", "/replica1/0.exp_avg"),
and a load on the same mesh shape puts them back. Resuming on the same mesh shape restores
everything bit for bit. A checkpoint of another mesh
shape (or without DiLoCo) has none of this rank's keys: the anchors are taken afresh from
the loaded parameters and the period starts again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hsdp.checkpoint.full_state import clean_key
from hsdp.runtime.hooks import units_below
from hsdp.sharding.group import ParamGroup

KEY = "hsdp_outer_sync"
FIELDS = ("anchor", "momentum", "pending", "steps", "apply_at")


def anchored_groups(model: nn.Module) -> Iterator[tuple[str, ParamGroup]]:
    """(key, group) of every group of ``model`` with DiLoCo state."""
    names = {id(m): clean_key(n) for n, m in model.named_modules()}
    for unit in units_below(model):
        for g in unit.groups:
            if g.anchor is None:
                continue
            c = g.comms
            t = 0 if c.host_tp is None else dist.get_rank(c.host_tp)
            where = f"{c.outer_size}x{c.inner_size}x{c.tp_size}:{c.inner_rank}-{t}"
            yield f"{names.get(id(unit.module), unit.label)}/{g.label.rsplit('/', 1)[1]}@{where}", g


def _replica_local(model: nn.Module, opt_state: Mapping[torch.Tensor, dict] | None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of what differs between outer replicas: each group's shard ``main``
    and the optimizer's elementwise state of its parameters (the model's and optimizer's
    own entries hold one replica's, as their DTensors are replicated over outer)."""
    for key, g in anchored_groups(model):
        mine = f"{key}/replica{g.comms.outer_rank}"
        yield f"{mine}/main", g.main
        for idx, p in enumerate(q.sharded for q in g.params):
            for name, value in (opt_state or {}).get(p, {}).items():
                if isinstance(value, DTensor) and value.dim() > 0:
                    yield f"{mine}/{idx}.{name}", value._local_tensor


def outer_sync_state(model: nn.Module, opt_state: Mapping[torch.Tensor, dict] | None = None
                     ) -> dict[str, torch.Tensor]:
    """This rank's outer state and replica-local values (copies), by key; ``opt_state``:
    the optimizer's state per parameter (the state a first step would create where it
    has none yet, so that a load has tensors to read into)."""
    out = {f"{key}/{name}": value for key, g in anchored_groups(model)
           for name, value in g.anchor.state(g.main).items()}
    out.update((k, v.detach().clone()) for k, v in _replica_local(model, opt_state))
    return out


def in_checkpoint(state: dict[str, torch.Tensor], saved: dict[str, object],
                  prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``state`` that the checkpoint's metadata ``saved`` (DCP's flattened
    keys, ``prefix`` + key) holds with the same shape: the ones to load."""
    return {k: v for k, v in state.items() if prefix + k in saved
            and tuple(getattr(saved[prefix + k], "size", ())) == tuple(v.shape)}


def load_outer_sync(model: nn.Module, state: dict[str, torch.Tensor] | None,
                    opt_state: Mapping[torch.Tensor, dict] | None = None) -> None:
    """Set this rank's outer state from ``state`` (``outer_sync_state``'s form); a group
    whose keys are missing starts afresh. Replica-local values found in ``state``
    replace what the model's and optimizer's entries loaded (``opt_state``: the
    optimizer state by parameter)."""
    state = state or {}
    for key, g in anchored_groups(model):
        found = {name: state.get(f"{key}/{name}") for name in FIELDS}
        g.anchor.load(found if all(v is not None for v in found.values()) else None,
                      g.main.device)
    restore_replica_local(model, state, opt_state)


@torch.no_grad()
def restore_replica_local(model: nn.Module, state: dict[str, torch.Tensor],
                          opt_state: Mapping[torch.Tensor, dict] | None = None) -> None:
    """Copy this rank's replica-local values found in ``state`` (``outer_sync_state``'s
    form) into its shards and optimizer state. Also what puts them back after a model
    load of the same checkpoint wrote outer replica 0's parameters over them (torchtitan
    loads the model after the optimizer)."""
    for key, target in list(_replica_local(model, opt_state)):
        if key in state:
            target.copy_(state[key])
