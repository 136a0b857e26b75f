"""``RuntimeContext``: what the parts of a model's runtime share (``runtime.py`` builds it
and hands it to ``Schedule``, ``Gathering``, ``Recovery``, ``Graphs`` and
``OptimizerSteps``): the units and groups, the communicators, streams and op table, and
the current ``Step`` (``step.py``), which alone changes the step's state and log. Every
field is set once, here; the parts change only what they own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hsdp.runtime.step import Step
from hsdp.sharding.comm import Collectives
from hsdp.sharding.group import ParamGroup
from hsdp.streams.contract import Event, SideStream
from hsdp.streams.op_table import Op, OpKind
from hsdp.streams.stream_set import Streams
from hsdp.topology.communicators import CommGroups
from hsdp.topology.outer_mode import OuterSchedule

if TYPE_CHECKING:
    from hsdp.runtime.unit import Unit


@dataclass
class RuntimeContext:
    """The state a model's runtime parts share; each part keeps the rest of its own."""

    root: Unit
    units: list[Unit]
    groups: list[ParamGroup]  # same order on every rank
    comms: CommGroups
    coll: Collectives
    streams: Streams
    ops: dict[OpKind, Op]  # the one place streams are chosen
    step: Step  # changed only through its methods
    outer: OuterSchedule = field(default_factory=OuterSchedule)  # the outer modes' schedule

    def __post_init__(self) -> None:
        self.gid = {g: i for i, g in enumerate(self.groups)}

    def stream_of(self, kind: OpKind) -> SideStream:
        """The side stream ops of ``kind`` are issued on (the op table's entry)."""
        return getattr(self.streams, self.ops[kind].stream)

    def logged(self, kind: OpKind, g: ParamGroup, event: Event) -> Event:
        """``event`` of a collective of ``kind`` on ``g``, logged for the step agreement."""
        self.step.log.add(kind, self.gid[g], self.ops[kind].stream, event)
        return event

    @property
    def trainable(self) -> list[ParamGroup]:
        """Groups with gradient state (trainable now or earlier), in group order."""
        return [g for g in self.groups if g.has_grads]

    def release_cleared_grads(self, graphed: bool) -> None:
        """Once the user has cleared the gradients (zero_grad), free their buffers until
        the next reduce-scatter needs them, so they are not held through the forward;
        never once a graph was captured (``graphed``: it writes them at their addresses)."""
        groups = [g for u in self.units for g in u.with_grads
                  if g.grads_live and not g.grads_exposed()]
        if groups and not graphed:  # a graph writes them at fixed addresses: kept
            # rs / outer wait: the optimizer on compute may still read the gradients.
            read = self.streams.compute.record()
            for g in groups:
                g.release_grads(self.stream_of(OpKind.FREE_ACCUM),
                                self.stream_of(OpKind.FREE_GRAD_BUF), [read])

    def reset_units(self) -> None:
        """The units' and groups' per-backward flags, for the next backward."""
        for u in self.units:
            u.reset_backward()
        for g in self.trainable:
            g.reset_backward()
