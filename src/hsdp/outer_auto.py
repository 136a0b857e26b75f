"""The outer axis's mode chosen from a measurement: ``hsdp.Auto``.

``auto = hsdp.Auto(chooser)`` (``hsdp_tools.auto(model)`` makes one whose chooser measures
the mesh's links and prices each mode with the simulator) is given to
``init_mesh(outer_sync=auto)`` and ``fully_shard(outer_reduce=auto)``. The first of them
for a mesh calls ``chooser(mesh)`` on every rank, once: it returns an ``OuterChoice`` (the
``outer_reduce`` and ``outer_sync`` to use, and why). Before anything uses it, every rank
checks that it is one and that every rank chose the same settings; a chooser that raised,
returned something else or chose differently on some rank raises on every rank, naming
each rank's outcome, and nothing was changed. The choice is logged once (rank 0, logger
``hsdp.outer_auto``, level INFO) with the chooser's reasons, then ``init_mesh`` sets its
DiLoCo (or none) on the mesh and ``fully_shard`` its ``outer_reduce`` (or the exact
reduction). A choice of DiLoCo needs the mesh made with the same ``Auto``
(``init_mesh(outer_sync=auto)``): ``fully_shard`` raises otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hsdp.runtime.diloco import DiLoCo
from hsdp.runtime.outer_modes import as_mode
from hsdp.sharding.outer_reduce import OuterReduce
from hsdp.topology.build_agreement import agree_in_store
from hsdp.topology.communicators import comm_groups
from hsdp.topology.mesh_dims import mesh_key
from hsdp.topology.outer_mode import outer_sync_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OuterChoice:
    """A chooser's answer: ``outer_reduce`` for ``fully_shard`` (an ``OuterReduce``, its
    short form, or None: the exact reduction), ``outer_sync`` for ``init_mesh`` (a
    ``DiLoCo`` or None: every step) and ``why``: the numbers behind it (logged)."""

    outer_reduce: OuterReduce | str | None
    outer_sync: DiLoCo | None
    why: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "outer_reduce", as_mode("outer_reduce", self.outer_reduce))
        if self.outer_sync is not None and not isinstance(self.outer_sync, DiLoCo):
            raise TypeError(f"hsdp.OuterChoice: outer_sync must be an hsdp.DiLoCo or None, "
                            f"got {self.outer_sync!r}")
        if not isinstance(self.why, str):
            raise TypeError(f"hsdp.OuterChoice: why must be a str, got {self.why!r}")

    def settings(self) -> str:
        """The choice without its reasons (what every rank must agree on)."""
        return f"outer_reduce={self.outer_reduce}, outer_sync={self.outer_sync}"


class Auto:
    """``outer_sync`` / ``outer_reduce`` chosen once per mesh by ``chooser(mesh)`` (module
    doc); ``name`` says which chooser in messages."""

    def __init__(self, chooser: Callable[[DeviceMesh], OuterChoice], name: str = "chooser"):
        if not callable(chooser):
            raise TypeError(f"hsdp.Auto: chooser must be callable (mesh -> hsdp.OuterChoice), "
                            f"got {chooser!r}")
        self.chooser, self.name = chooser, name
        self._choices: dict[tuple, OuterChoice] = {}

    def __repr__(self) -> str:
        return f"hsdp.Auto({self.name})"

    def choice(self, mesh: DeviceMesh) -> OuterChoice:
        """The choice for ``mesh``: made (every rank calls it), checked, agreed and logged
        the first time, the same afterwards."""
        key = mesh_key(mesh)
        if key not in self._choices:
            self._choices[key] = self._choose(mesh)
        return self._choices[key]

    def _choose(self, mesh: DeviceMesh) -> OuterChoice:
        choice, error = None, None
        try:
            choice = self.chooser(mesh)
            if not isinstance(choice, OuterChoice):
                raise TypeError(f"the chooser returned {type(choice).__name__}, not an "
                                f"hsdp.OuterChoice")
            said = choice.settings()
        except Exception as exc:  # noqa: BLE001 - told to every rank below
            error = exc
            said = f"error: {type(exc).__name__}: {exc}"
        agree_in_store(f"{self!r}", said, comm_groups(mesh).timeout,
                       "The chooser must return the same hsdp.OuterChoice on every rank "
                       "(decide on rank 0 and broadcast it). Nothing was changed.")
        if error is not None:  # the same error on every rank
            raise RuntimeError(f"{self!r}: choosing the outer axis's mode failed on every "
                               f"rank; nothing was changed: {said[7:]}") from error
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("hsdp: %r chose %s for mesh %s: %s", self, choice.settings(),
                     tuple(mesh.shape), choice.why or "(no reasons given)")
        return choice

    def outer_sync_for(self, mesh: DeviceMesh) -> DiLoCo | None:
        """``init_mesh``'s ``outer_sync`` on ``mesh`` (a mesh without outer sync yet)."""
        return self.choice(mesh).outer_sync

    def outer_reduce_for(self, mesh: DeviceMesh) -> OuterReduce | None:
        """``fully_shard``'s ``outer_reduce`` on ``mesh``; raises where the choice is
        DiLoCo and ``mesh`` was not made with it."""
        choice = self.choice(mesh)
        have = outer_sync_of(mesh)
        if have != choice.outer_sync:
            raise ValueError(
                f"fully_shard: {self!r} chose outer_sync={choice.outer_sync} but the mesh has "
                f"outer_sync={have}: pass the same hsdp.Auto to init_mesh(outer_sync=...) "
                f"as to fully_shard(outer_reduce=...). Nothing was changed.")
        return choice.outer_reduce
