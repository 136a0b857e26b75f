"""The op table: every kind of op hsdp issues on a side stream, and where it runs.

ONE table maps each ``OpKind`` to the stream it is issued on, the communicator its
collective runs on (None: no collective) and the label its stream ops carry
("RS:<group>"). The schedule picks a stream only through it; the replay of an abandoned
step, the step agreement's counts per communicator, the bench's metric labels, the
timeline's colours and the simulator's costs all derive from it.

The serialized baseline (``overlap_outer=False``) differs from the overlapped schedule in
one field of the table: the stream of the outer reduction (docs/design.md, "Streams and
communicators").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class OpKind(Enum):
    GATHER = "inner all-gather of a group's parameters"
    FREE_GATHERED = "free of the gathered parameters"
    REDUCE_SCATTER = "inner reduce-scatter of a group's gradients"
    OUTER_ALL_REDUCE = "hsdp: outer all-reduce of the inner shard's gradients"
    OUTER_REDUCE_SCATTER = "hfsdp: outer reduce-scatter of the inner shard's gradients"
    OUTER_Q_ALL_REDUCE = "hsdp, outer_reduce: compressed outer all-reduce (all-to-all + all-gather)"
    OUTER_Q_REDUCE_SCATTER = "hfsdp, outer_reduce: compressed outer reduce-scatter (all-to-all)"
    OUTER_ALL_GATHER = "hfsdp: outer all-gather of the chunks the optimizer updated"
    OUTER_Q_ALL_GATHER = "hfsdp, outer_gather: compressed outer all-gather of the updated chunks"
    OUTER_SYNC = "DiLoCo: outer all-reduce of a fragment's pseudo-gradient (fp32)"
    FREE_ACCUM = "free of the inner gradient accumulation"
    FREE_GRAD_BUF = "hfsdp: free of the outer reduce-scatter's output"


@dataclass(frozen=True)
class Op:
    """Where one kind of op runs: ``stream`` (a side stream of ``Streams``),
    ``communicator`` (of ``CommGroups``; None: no collective), ``label`` (its ops'
    label prefix)."""

    stream: str
    communicator: str | None
    label: str


def op_table(overlap_outer: bool) -> dict[OpKind, Op]:
    """The table of a schedule; ``overlap_outer=False``: the serialized baseline."""
    outer_reduction = "outer" if overlap_outer else "rs"
    return {
        OpKind.GATHER: Op("ag", "inner_ag", "AG"),
        OpKind.FREE_GATHERED: Op("ag", None, "FREE"),
        OpKind.REDUCE_SCATTER: Op("rs", "inner_rs", "RS"),
        OpKind.OUTER_ALL_REDUCE: Op(outer_reduction, "outer", "OUTER_AR"),
        OpKind.OUTER_REDUCE_SCATTER: Op(outer_reduction, "outer", "OUTER_RS"),
        OpKind.OUTER_Q_ALL_REDUCE: Op(outer_reduction, "outer", "OUTER_QAR"),
        OpKind.OUTER_Q_REDUCE_SCATTER: Op(outer_reduction, "outer", "OUTER_QRS"),
        OpKind.OUTER_ALL_GATHER: Op("outer", "outer", "OUTER_AG"),
        OpKind.OUTER_Q_ALL_GATHER: Op("outer", "outer", "OUTER_QAG"),
        OpKind.OUTER_SYNC: Op("outer", "outer", "OUTER_SYNC"),
        OpKind.FREE_ACCUM: Op("rs", None, "FREE_GRAD"),
        OpKind.FREE_GRAD_BUF: Op("outer", None, "FREE_GRAD"),
    }


OPS = op_table(overlap_outer=True)  # streams aside, every schedule's table is this one
OUTER_REDUCTIONS = (OpKind.OUTER_ALL_REDUCE, OpKind.OUTER_REDUCE_SCATTER,
                    OpKind.OUTER_Q_ALL_REDUCE, OpKind.OUTER_Q_REDUCE_SCATTER)
OUTER_GATHERS = (OpKind.OUTER_ALL_GATHER, OpKind.OUTER_Q_ALL_GATHER)
_BY_LABEL = sorted(((op.label, op.communicator) for op in OPS.values()),
                   key=lambda entry: -len(entry[0]))  # "OUTER_AG" before "OUTER"-less ones


def label(kind: OpKind, name: str) -> str:
    """The label of one op of ``kind`` on ``name`` (a group): "RS:LlamaBlock3/0"."""
    return f"{OPS[kind].label}:{name}"


def communicator_of(op_label: str) -> str | None:
    """The communicator of a stream op by its label, i.e. by the longest table label it
    starts with ("RS:blocks.0", "RS1" -> "inner_rs"); None for ops without a collective
    and for labels of no hsdp op ("drain")."""
    for prefix, communicator in _BY_LABEL:
        if op_label.startswith(prefix):
            return communicator
    return None
