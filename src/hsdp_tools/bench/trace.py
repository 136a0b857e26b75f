"""Turn what the runtime records into ``Interval``s for ``metrics.step_metrics``.

Two sources:

- CPU: ``hsdp.streams.contract.OpRecord``s from the ``Tracer`` (host start/end of each op on each
  stream thread). The compute "stream" is the calling thread, busy except while it blocks
  on a side stream; the runtime records those waits on stream ``"compute"`` with labels
  starting ``"wait"``, and compute busy time is their complement within the step.
- CUDA: a ``torch.profiler`` Chrome trace. The runtime wraps each side-stream op in
  ``record_function("hsdp:{stream}:{label}")``; GPU activity is tied to an op through the
  launch call (same correlation id) made inside that annotation's host time range.

Why not HolisticTraceAnalysis: its comm/compute overlap classifies kernels by name and
merges all communication kernels into one set of intervals, so two collectives running
at once (inner and outer, on different communicators) become one busy span and their
overlap, the quantity we care about, cannot be read from it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path

from hsdp.streams.contract import OpRecord
from hsdp_tools.report.chrome_trace import (
    SIDE_OP,
    end_us,
    load_chrome_trace,
    read_events,
    thread_of,
)
from hsdp_tools.report.metrics import Interval, subtract, union


def intervals_from_records(records: Iterable[OpRecord], t0: float,
                           t1: float | None = None) -> list[Interval]:
    """Intervals in us since ``t0`` (host seconds, ``time.perf_counter``) of CPU records.

    Side-stream records map one to one. Compute records labelled ``"wait..."`` are the
    compute thread blocked on another stream: compute is busy over ``[t0, t1]`` minus the
    union of those waits (``t1`` defaults to the last end of any record). Other compute
    records add nothing: that time is already busy in the complement.
    """
    recs = list(records)
    if t1 is None:
        t1 = max((r.end_s for r in recs), default=t0)

    def us(t: float) -> float:
        return (t - t0) * 1e6

    out = [Interval(r.stream, r.label, us(r.start_s), us(r.end_s))
           for r in recs if r.stream != "compute"]
    waits = union((us(r.start_s), us(r.end_s)) for r in recs
                  if r.stream == "compute" and r.label.startswith("wait"))
    busy = subtract([(0.0, us(t1))], waits) if t1 > t0 else []
    out += [Interval("compute", "compute", lo, hi) for lo, hi in busy]
    return sorted(out, key=lambda iv: (iv.start_us, iv.stream))


def host_marks(records: Iterable[OpRecord], t0: float) -> list[list]:
    """The host side of a CUDA step without the profiler, named as the profiler's
    annotations are: ``[thread, name, start us, duration us]`` of each phase mark
    (``hsdp.begin:<phase>`` / ``hsdp.end:<phase>``) and side-op submit
    (``hsdp:<stream>:<label>``); ``hsdp_tools.sim.calibrate`` reads them."""
    out = []
    for r in records:
        if r.stream == "compute" and r.label.startswith(("begin:", "end:")):
            name = f"hsdp.{r.label}"
        elif r.label.startswith("submit:"):
            name = f"{SIDE_OP}{r.stream}:{r.label[len('submit:'):]}"
        else:
            continue
        out.append([r.thread, name, round((r.start_s - t0) * 1e6, 3),
                    round((r.end_s - r.start_s) * 1e6, 3)])
    return out


def intervals_from_chrome_trace(trace: dict | str | Path) -> list[Interval]:
    """One ``Interval`` per hsdp op that ran on the GPU, plus compute kernels.

    An op's interval spans its first to its last GPU event (kernel, memcpy, memset); its
    GPU events are those whose launch (``cuda_runtime`` / ``cuda_driver`` event with the
    same ``args.correlation``) lies inside the op's ``hsdp:`` annotation on the same host
    thread (the innermost one if nested). GPU events outside every hsdp op, on a CUDA
    stream that carries no hsdp op, become ``"compute"`` intervals labelled with the
    kernel name; those on a hsdp stream are dropped. Times are the trace's (us).
    """
    if not isinstance(trace, dict):
        trace = load_chrome_trace(trace)
    events = read_events(trace, (SIDE_OP,))
    threads = {t: _Annotations(notes) for t, notes in events.annotations.items()}

    spans: dict[int, tuple[dict, float, float]] = {}  # id(annotation) -> (it, first, last)
    hsdp_lanes: set[tuple] = set()
    loose: list[dict] = []
    for e in events.gpu:
        launch = events.launch_of(e)
        notes = threads.get(thread_of(launch)) if launch else None
        note = notes.owner(launch["ts"]) if notes else None
        if note is None:
            loose.append(e)
            continue
        hsdp_lanes.add(_lane(e))
        _, lo, hi = spans.get(id(note), (note, e["ts"], end_us(e)))
        spans[id(note)] = (note, min(lo, e["ts"]), max(hi, end_us(e)))

    out = []
    for note, lo, hi in spans.values():
        _, stream, label = note["name"].split(":", 2)
        out.append(Interval(stream, label, lo, hi))
    out += [Interval("compute", e.get("name", ""), e["ts"], end_us(e))
            for e in loose if _lane(e) not in hsdp_lanes]
    return sorted(out, key=lambda iv: (iv.start_us, iv.stream))


class _Annotations:
    """One host thread's hsdp annotations, nested like the record_function stack."""

    def __init__(self, events: list[dict]) -> None:
        self.events = sorted(events, key=lambda e: (e["ts"], -end_us(e)))
        self.starts = [e["ts"] for e in self.events]
        self.parent: list[int | None] = []  # index of the enclosing annotation
        stack: list[int] = []
        for i, e in enumerate(self.events):
            while stack and end_us(self.events[stack[-1]]) <= e["ts"]:
                stack.pop()
            self.parent.append(stack[-1] if stack else None)
            stack.append(i)

    def owner(self, ts: float) -> dict | None:
        """The innermost annotation whose time range contains ``ts``."""
        i: int | None = bisect.bisect_right(self.starts, ts) - 1
        while i is not None and i >= 0:
            if end_us(self.events[i]) >= ts:
                return self.events[i]
            i = self.parent[i]
        return None


def _lane(e: dict) -> tuple:
    """The CUDA stream a GPU event ran on: (device, stream)."""
    args = e.get("args") or {}
    return args.get("device", e.get("pid")), args.get("stream", e.get("tid"))
