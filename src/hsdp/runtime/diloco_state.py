"""DiLoCo's outer state in checkpoints: the ``DiLoCo`` mode's state-dict hooks
(``diloco.py``, ``topology/outer_mode.py``) for each group's fp32 anchor, outer momentum
and step count (``sharding/anchor.py``).

The anchor lies like its group's inner shard and is the same on every outer replica, so it
is saved as plain tensors keyed by mesh shape and this rank's inner (and tp) coordinates
("4x2x1:1-0/anchor"; in the optimizer's state dict under ``DiLoCo.state_key`` after the
group's name, "blocks.0/0@4x2x1:1-0/anchor"): the outer replicas write the same key with
the same values, which DCP stores once. Between syncs the replicas' parameters and inner
optimizer state differ, while their DTensors (replicated over outer) are stored once: each
rank also saves its own shard of them under the same key, with its outer coordinate
("/replica1/main", "/replica1/0.exp_avg"), and a load on the same mesh shape puts them
back. Resuming on the same mesh shape restores everything bit for bit. A checkpoint of
another mesh shape (or without DiLoCo) has none of this rank's keys: the anchors are taken
afresh from the loaded parameters and the period starts again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch.distributed.tensor import DTensor

from hsdp.sharding.group import ParamGroup
from hsdp.topology.outer_mode import Entries, place

FIELDS = ("anchor", "momentum", "pending", "steps", "apply_at")


def _replica_local(g: ParamGroup, opt_state: Mapping | None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of what differs between outer replicas: ``g``'s shard ``main`` and
    the optimizer's elementwise state of its parameters (the model's and optimizer's own
    entries hold one replica's, as their DTensors are replicated over outer)."""
    mine = f"{place(g.comms, outer=False)}/replica{g.comms.outer_rank}"
    yield f"{mine}/main", g.main
    for idx, p in enumerate(q.sharded for q in g.params):
        for name, value in (opt_state or {}).get(p, {}).items():
            if isinstance(value, DTensor) and value.dim() > 0:
                yield f"{mine}/{idx}.{name}", value._local_tensor


def state(g: ParamGroup, opt_state: Mapping | None) -> Entries:
    """``g``'s outer state and replica-local values (copies), by key; ``opt_state``: the
    optimizer's state per parameter."""
    where = place(g.comms, outer=False)
    out = {f"{where}/{name}": value for name, value in g.anchor.state(g.main).items()}
    out.update((k, v.detach().clone()) for k, v in _replica_local(g, opt_state))
    return out


def load(g: ParamGroup, entries: Entries, opt_state: Mapping | None) -> None:
    """Set ``g``'s outer state from ``entries`` (``state``'s form); missing keys: start
    afresh. Replica-local values found in ``entries`` replace what the model's and
    optimizer's entries loaded (``opt_state``: the optimizer state by parameter)."""
    where = place(g.comms, outer=False)
    found = {name: entries.get(f"{where}/{name}") for name in FIELDS}
    g.anchor.load(found if all(v is not None for v in found.values()) else None,
                  g.main.device)
    restore_replica_local(g, entries, opt_state)


@torch.no_grad()
def restore_replica_local(g: ParamGroup, entries: Entries, opt_state: Mapping | None
                          ) -> None:
    """Copy this rank's replica-local values found in ``entries`` into ``g``'s shard and
    optimizer state. Also what puts them back after a model load of the same checkpoint
    wrote outer replica 0's parameters over them."""
    for key, target in list(_replica_local(g, opt_state)):
        if key in entries:
            target.copy_(entries[key])
