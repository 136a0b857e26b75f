"""Step metrics from op intervals: busy time, comm-comm overlap, exposed comm, outer tail.

Names follow ``docs/design.md`` ("What is measured"). Intervals are in microseconds, results
in milliseconds. An op's kind comes from its stream and label, with the runtime's labels:

- stream ``"compute"``: compute (kernels, or on CPU the compute thread while not waiting);
- otherwise the communicator of the op table's label the op's label starts with
  (``hsdp.streams.op_table``: ``"OUTER_AR"`` / ``"OUTER_RS"`` / ``"OUTER_AG"``: outer;
  ``"AG"``: inner_ag; ``"RS"``: inner_rs);
- anything else (e.g. ``"drain"``, ``"FREE"``): ``"other"``, counted per stream but in no
  kind.

Communication is classified by label, not by stream: the serialized baseline runs the
outer reduction on the ``rs`` stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hsdp.streams.op_table import OPS, OUTER_REDUCTIONS, communicator_of
from hsdp.topology.communicators import COMMUNICATORS

Span = tuple[float, float]

KINDS = ("compute", "inner", "outer")
OUTER_REDUCTION_LABELS = tuple(OPS[k].label for k in OUTER_REDUCTIONS)
OP_KINDS = ("compute", *COMMUNICATORS, "other")


@dataclass(frozen=True)
class Interval:
    """One op on one stream, from ``start_us`` to ``end_us``."""

    stream: str
    label: str
    start_us: float
    end_us: float


def op_kind(iv: Interval) -> str:
    """One of ``OP_KINDS`` (see the module docstring)."""
    if iv.stream == "compute":
        return "compute"
    return communicator_of(iv.label) or "other"


def kind(iv: Interval) -> str:
    """``op_kind`` with a communicator replaced by its mesh axis (inner AG and RS merged
    into ``"inner"``)."""
    k = op_kind(iv)
    return k.split("_", 1)[0] if k in COMMUNICATORS else k


# --------------------------------------------------------------------------- unions


def union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering exactly the same time as ``spans``."""
    out: list[Span] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def total(spans: Sequence[Span]) -> float:
    """Summed length of disjoint ``spans``."""
    return sum(hi - lo for lo, hi in spans)


def intersect(a: Sequence[Span], b: Sequence[Span]) -> list[Span]:
    """Time covered by both unions ``a`` and ``b``."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Span], b: Sequence[Span]) -> list[Span]:
    """Time covered by union ``a`` but not by union ``b``."""
    out: list[Span] = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > lo:
                out.append((lo, b[k][0]))
            lo = max(lo, b[k][1])
            k += 1
        if hi > lo:
            out.append((lo, hi))
    return out


def clip(spans: Sequence[Span], lo: float, hi: float) -> list[Span]:
    """Disjoint ``spans`` restricted to ``[lo, hi]``."""
    return intersect(spans, [(lo, hi)]) if hi > lo else []


# --------------------------------------------------------------------------- metrics


def step_metrics(intervals: Iterable[Interval], window: Span | None = None) -> dict:
    """Metrics of one step (or any stretch of time) as a JSON-ready dict.

    ``window`` (start_us, end_us) clips every interval; default: first start to last end.
    Keys (ms unless noted):

    - ``window_us``: the window used; ``span_ms``: its length.
    - ``busy_ms``: ``{"by_stream": {stream: ms}, "by_kind": {kind: ms}}``, each the length
      of the union of that stream's / kind's intervals; kinds are compute, inner, outer,
      inner_ag, inner_rs.
    - ``comm_busy_ms``: union of inner and outer.
    - ``comm_comm_overlap_ms``: time inner and outer comm are both busy.
    - ``exposed_comm_ms``: time some comm is busy while compute is idle.
    - ``outer_tail_ms``: from the end of compute to the end of the last outer collective:
      ``max(0, E - C)`` with E the end of the last outer interval and C the latest end of
      a compute interval starting before E (the window start if there is none); 0 when
      there is no outer interval.
    - ``tail_floor_ms``: duration of the last outer reduction (OUTER_AR / OUTER_RS): it
      needs the last gradients, so it cannot overlap the compute that produces them.
    - ``lower_bound_ms``: ``max(compute + tail_floor, inner, outer busy)``. Each kind owns
      its own resource (SMs, inner links, outer links), so no schedule of the same work
      can be shorter. Where the recorded last outer reduction does overlap compute (a
      stream interval that includes waiting, CPU threads sharing cores), the first term is
      the length of their union: a bound of the same intervals, never above ``span_ms``.
    """
    ivs = list(intervals)
    if window is None:
        window = ((min(iv.start_us for iv in ivs), max(iv.end_us for iv in ivs))
                  if ivs else (0.0, 0.0))
    lo, hi = window

    def busy(select) -> list[Span]:
        return clip(union((iv.start_us, iv.end_us) for iv in ivs if select(iv)), lo, hi)

    by_stream = {s: total(busy(lambda iv, s=s: iv.stream == s))
                 for s in sorted({iv.stream for iv in ivs})}
    spans = {k: busy(lambda iv, k=k: kind(iv) == k) for k in KINDS}
    for k in COMMUNICATORS:
        if k not in spans:  # "outer" is a communicator and an axis
            spans[k] = busy(lambda iv, k=k: op_kind(iv) == k)
    comm = union(spans["inner"] + spans["outer"])

    # The tail is the gradient path's: hfsdp's outer all-gather after the optimizer step
    # is not part of it.
    reductions = [iv for iv in ivs if iv.label.startswith(OUTER_REDUCTION_LABELS)]
    last = max(reductions, key=lambda iv: iv.end_us, default=None)
    floor = last.end_us - last.start_us if last else 0.0
    compute_then_tail = total(clip(union([*spans["compute"], *(
        [(last.start_us, last.end_us)] if last else [])]), lo, hi))
    outer_ends = [e for _, e in busy(lambda iv: iv.label.startswith(OUTER_REDUCTION_LABELS))]
    tail = 0.0
    if outer_ends:
        last = outer_ends[-1]
        compute_end = max((e for s, e in spans["compute"] if s < last), default=lo)
        tail = max(0.0, last - compute_end)

    def ms(us: float) -> float:
        return us / 1e3

    by_kind = {k: ms(total(v)) for k, v in spans.items()}
    return {
        "window_us": [lo, hi],
        "span_ms": ms(max(0.0, hi - lo)),
        "busy_ms": {"by_stream": {s: ms(v) for s, v in by_stream.items()},
                    "by_kind": by_kind},
        "comm_busy_ms": ms(total(comm)),
        "comm_comm_overlap_ms": ms(total(intersect(spans["inner"], spans["outer"]))),
        "exposed_comm_ms": ms(total(subtract(comm, spans["compute"]))),
        "outer_tail_ms": ms(tail),
        "tail_floor_ms": ms(floor),
        "lower_bound_ms": max(ms(compute_then_tail), by_kind["inner"], by_kind["outer"]),
    }
