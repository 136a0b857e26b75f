"""What a replica group that joins late or restarts receives from a live one.

hsdp's recovery transport (``ft/transport.py``) pairs rank ``i`` of the recovering group
with rank ``i`` of a live one: the same inner index, so the same shards. Each rank sends
the local pieces of its parameters and of the optimizer's elementwise state (views, not
copies: the transport has sent them before the live group's next optimizer step), its
buffers, the optimizer's hyperparameters and the LR scheduler's state; torchft adds its
step counter. Each group's outer modes add what they keep between steps
(``OuterMode.replica_state``: e.g. the anchors, momentum and step counts of a periodic
outer sync, asked for at a sync's quorum, when no outer step is pending). The receiver copies them
into its own pieces, so its values equal the sender's bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hsdp.checkpoint.extra_state import stateful
from hsdp.ft.errors import FaultToleranceError
from hsdp.runtime.step import Phase
from hsdp.sharding.pieces import Piece, piece_like
from hsdp.topology.communicators import comm_groups


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t._local_tensor if isinstance(t, DTensor) else t).detach()


class ReplicaState:
    """A replica's training state as torchft sends and receives it. The parameters (the
    sharded ones, which the optimizer holds) and buffers are looked up once, while the
    model is idle: torchft asks for the state on its quorum thread, while the step's
    forward may have swapped gathered parameters into the modules."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any | None) -> None:
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.modes = [(f"{m.state_key}/{name}", g, m) for name, g, m in stateful(model)]
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler

    def state_dict(self) -> dict[str, Any]:
        """This rank's part (views: nothing here waits for the model or changes it)."""
        names = {id(p): n for n, p in self.params.items()}
        state = {}
        for p, st in self.optimizer.state.items():
            state[names[id(p)]] = {
                "pieces": {k: _local(v) for k, v in st.items() if isinstance(v, DTensor)},
                "plain": {k: v for k, v in st.items() if not isinstance(v, DTensor)}}
        return {"params": {n: _local(p) for n, p in self.params.items()},
                "buffers": {n: b.detach() for n, b in self.buffers.items()},
                "optim_state": state,
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.optimizer.param_groups],
                "lr_scheduler": (None if self.lr_scheduler is None
                                 else self.lr_scheduler.state_dict()),
                "outer_modes": {k: m.replica_state(g) for k, g, m in self.modes}}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy the same inner rank's ``state_dict`` of a live replica into this one.
        **WHY a device synchronize first**: the state was placed on the device on
        torchft's recovery stream, which a synchronous quorum (``sync_quorum``) does not wait for
        before it applies the state."""
        if any(_local(p).is_cuda for p in self.params.values()):
            torch.cuda.synchronize()
        for n, p in self.params.items():
            _local(p).copy_(state["params"][n])
        for n, b in self.buffers.items():
            b.copy_(state["buffers"][n])
        for n, st in state["optim_state"].items():
            p = self.params[n]
            mine = self.optimizer.state[p]
            for k, v in st["pieces"].items():
                cur = mine.get(k)
                if isinstance(cur, DTensor) and _local(cur).shape == v.shape:
                    _local(cur).copy_(v)
                else:  # a fresh optimizer: new state, which hsdp packs after the next step
                    mine[k] = piece_like(p, v.clone()) if isinstance(p, Piece) else v.clone()
            for k, v in st["plain"].items():
                mine[k] = v.clone() if isinstance(v, torch.Tensor) else v
        groups = self.optimizer.param_groups
        if len(groups) != len(state["param_groups"]):
            raise FaultToleranceError(f"hsdp: the live replica's optimizer has "
                                      f"{len(state['param_groups'])} parameter groups, this "
                                      f"one {len(groups)}")
        for mine, theirs in zip(groups, state["param_groups"]):
            mine.update(theirs)
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for k, g, m in self.modes:
            m.recover(g, state["outer_modes"][k])


def fault_tolerance(model: nn.Module, optimizer: torch.optim.Optimizer,
                    lr_scheduler: Any | None = None) -> Any:
    """The torchft ``Manager`` of ``model``'s mesh (``init_mesh(..., fault_tolerance=...)``),
    with ``model``, ``optimizer`` and ``lr_scheduler`` registered as what a recovering
    replica group receives. Each step: ``manager.start_quorum()`` before the forward, and
    ``optimizer.step()`` (and the scheduler's) only if ``manager.should_commit()``. With
    an outer mode whose syncs are quorums (``OuterMode.sync_quorum``) the loop calls
    neither: hsdp runs each sync's quorum and commit inside
    ``optimizer.step()``."""
    inner = getattr(model, "_orig_mod", model)
    unit = getattr(inner, "_hsdp_unit", None)
    if unit is None:
        raise ValueError("hsdp.fault_tolerance expects the root module passed to "
                         "hsdp.fully_shard")
    elastic = comm_groups(unit.mesh).elastic
    if elastic is None:
        raise FaultToleranceError("hsdp.fault_tolerance: the model's mesh has no fault "
                                  "tolerance; build it with hsdp.init_mesh(..., "
                                  "fault_tolerance=hsdp.FaultTolerance(...))")
    if unit.runtime is not None and unit.runtime.step.phase in (Phase.FORWARD, Phase.BACKWARD):
        raise RuntimeError("hsdp.fault_tolerance: called during forward or backward")
    state = ReplicaState(model, optimizer, lr_scheduler)
    elastic.manager.register_state_dict_fn("hsdp", state.load_state_dict, state.state_dict)
    return elastic.manager
