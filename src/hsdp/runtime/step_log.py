"""``StepLog``: the collectives this rank issued in the current step (kind, group id,
stream), what the step agreement (``agreement.py``) compares across ranks and recovery
replays from."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from hsdp.streams.contract import Event
from hsdp.streams.op_table import OPS, OpKind
from hsdp.topology.communicators import COMMUNICATORS

Desc = tuple[OpKind, int, str]  # (kind, group id, stream name): the same on every rank


@dataclass
class Issued:
    desc: Desc
    event: Event


@dataclass
class StepLog:
    """What this rank issued since the last agreement (or recovery)."""

    step: int = 0
    forwards: int = 0
    microbatches: int = 0
    ops: list[Issued] = field(default_factory=list)

    def add(self, kind: OpKind, gid: int, stream: str, event: Event) -> None:
        self.ops.append(Issued((kind, gid, stream), event))

    def count_forward(self) -> None:
        self.forwards += 1

    def count_microbatch(self) -> None:
        self.microbatches += 1

    def descs(self) -> list[Desc]:
        return [op.desc for op in self.ops]

    def fields(self) -> list[int]:
        counts = dict.fromkeys(COMMUNICATORS, 0)
        crcs = dict.fromkeys(COMMUNICATORS, 0)
        for kind, gid, stream in self.descs():
            comm = OPS[kind].communicator  # the op table's: the same for every schedule
            counts[comm] += 1
            crcs[comm] = zlib.crc32(f"{kind.name}:{gid}:{stream};".encode(), crcs[comm])
        return [self.step, self.forwards, self.microbatches, *counts.values(), *crcs.values()]

    def forget(self) -> None:
        """Drop what this step has logged so far (every rank does, at the same point)."""
        self.forwards = self.microbatches = 0
        self.ops.clear()

    def next_step(self) -> None:
        self.step += 1
        self.forget()
