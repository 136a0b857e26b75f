"""Phases of a profiled step (``TracePhases``): host and device time per phase class read
from a Chrome trace's phase marks, and what calibration takes from several steps and ranks
(the least device time, collective drag, peer waits, host marks, exclusive shares);
saved beside a bench JSON so a committed run keeps them without its traces
(``calibrate.py`` says how the cost model uses them)."""

from __future__ import annotations

import bisect
import dataclasses
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from hsdp_tools.report.chrome_trace import MARK, SIDE_OP, load_chrome_trace, read_events, thread_of
from hsdp_tools.report.metrics import Interval, op_kind
from hsdp_tools.sim.costs import (
    phase_class,
    phase_kind,
    side_class,
)

# a trace's phases saved beside its JSON (``save_phases``): the calibration needs no trace
PHASES_SUFFIX = ".phases.json"


# Kernels of a collective (NCCL's; the emulation's sleep): they run beside compute. A side
# op's other kernels (its casts and copies) compete with compute for the SMs.
COLLECTIVE_KERNELS = ("nccl", "spin_kernel")


# Collective kernels that slow compute down beside them (``collective_drag``): NCCL's. The
# emulation's one-SM sleep kernel gave the blocks' backward slopes of 0.05-0.5 too, but
# compute without it was not that much faster: priced so, the collective-free steps of
# emulated seq-4096 rows came out 3-11 % lower, away from their measured ones (which run
# no sleep kernels at all) in four of five.
DRAG_KERNELS = ("nccl",)


# ``collective_drag``: with fewer instances of a phase class, or less overlap between
# them (ms, over the profiled steps), its drag is not measured (0); above MAX_DRAG compute
# beside a collective would barely move, which no trace showed (at most 0.6).
MIN_INSTANCES = 4


MIN_BESIDE_MS = 0.5


MAX_DRAG = 0.9


# A launch call this long waited for room in the GPU's launch queue: the host was ahead of
# the GPU, and that wait is the GPU's time, not the host's (AdamW's foreach kernels over a
# whole unsharded model: 35 ms of a 49 ms optimizer host span).
BLOCKED_US = 50.0


QUEUED_CALLS = ("cudaLaunch", "cuLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def trace_paths(entry: dict) -> list[str]:
    """The Chrome traces of a schedule's profiled steps as its JSON entry names them, the
    first (whose metrics the entry holds) first; older JSONs name one, ``trace``."""
    return entry.get("traces") or ([entry["trace"]] if entry.get("trace") else [])


def recorded_steps(entry: dict, key: str) -> list[list[list]]:
    """Per recorded step (without the profiler), a schedule entry's ``key``
    (``host_marks`` or ``side_ms``): ``<key>_steps``, or an older JSON's one step
    ``<key>``; steps that recorded nothing (``side_ms`` on CPU) left out."""
    steps = entry.get(f"{key}_steps") or [entry.get(key)]
    return [step for step in steps if step]


def find_trace(json_path: str | Path, trace: str | None) -> Path | None:
    """The trace a JSON names: as written, or (copied along) next to the JSON; else the
    phases saved from it next to the JSON (``save_phases``)."""
    if not trace:
        return None
    here = Path(json_path).parent
    for candidate in (Path(trace), here / Path(trace).name, here / phases_path(trace).name):
        if candidate.exists():
            return candidate
    return None


def phases_path(trace: str | Path) -> Path:
    """Where ``save_phases`` keeps a trace's phases: beside it, ``<name>.phases.json``."""
    name = Path(trace).name.removesuffix(".gz").removesuffix(".json")
    return Path(trace).with_name(name + PHASES_SUFFIX)


def read_phases(path: str | Path) -> TracePhases:
    """A profiled step's phases: from its Chrome trace, or from those saved from it."""
    if not str(path).endswith(PHASES_SUFFIX):
        return phases_from_trace(load_chrome_trace(path))
    saved = json.loads(Path(path).read_text())
    return TracePhases(**saved | {"instances": [tuple(i) for i in saved["instances"]]})


def save_phases(json_path: str | Path) -> list[Path]:
    """Save beside a ``bench step`` JSON the phases of every trace it names (all that the
    calibration reads of a trace: a few KB against a few hundred), so that the JSON
    calibrates without its traces; returns the files written."""
    data = json.loads(Path(json_path).read_text())
    written = []
    for entry in data["schedules"].values():
        for name in trace_paths(entry or {}):
            trace = find_trace(json_path, name)
            if trace is None or str(trace).endswith(PHASES_SUFFIX):
                continue
            out = Path(json_path).parent / phases_path(name).name
            out.write_text(json.dumps(dataclasses.asdict(read_phases(trace)),
                                      separators=(",", ":")))
            written.append(out)
    return written


@dataclasses.dataclass
class TracePhases:
    """Per phase class: instances, host ms and device ms in total; per ``side_class``
    ("rs:FREE_GRAD"), its ops' host ms; the main thread's host span of the step (first
    mark to the optimizer's end), ms; per side op kind, the share of its own kernels' time
    alone on the GPU (``CostModel.exclusive``); per side op's phase class
    ("AG:LlamaBlock/0"), its ops' collective kernel time, ms; per phase class, the host
    time blocked in launch calls (already taken out of its host ms); per phase instance,
    its device time beside collective kernels, and per class the drag measured on them."""

    phases: dict[str, list[float]]  # class -> [instances, host_ms, device_ms]
    side_host_ms: dict[str, list[float]]  # ``side_class`` -> each op's host ms
    span_ms: float
    exclusive: dict[str, float] = dataclasses.field(default_factory=dict)  # CostModel's
    collectives: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # ms per op
    blocked_ms: dict[str, float] = dataclasses.field(default_factory=dict)  # per class
    # per phase instance (its label; a unit's microbatches together): class, device ms,
    # ms of it beside a collective kernel; per class, the drag measured on them
    # (``least_device_time``)
    instances: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)
    drag: dict[str, float] = dataclasses.field(default_factory=dict)


def phases_from_trace(trace: dict) -> TracePhases:
    """Host and device time per phase class of a profiled step (module docstring)."""
    events = read_events(trace, (MARK, SIDE_OP))
    threads, launches = events.annotations, events.launches
    kernels = [k for k in events.gpu if "correlation" in (k.get("args") or {})]
    phases: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    side_host: dict[str, list[float]] = defaultdict(list)
    owner: dict[tuple, list[tuple[float, float, str | None]]] = {}  # thread -> spans
    span = 0.0
    for thread, events in threads.items():
        spans, span_t = _thread_spans(events, phases, side_host)
        owner[thread] = spans
        span = max(span, span_t)
    compute: list[tuple[float, float, float]] = []  # (start, end, launch) of compute kernels
    side: list[tuple[str, float, float]] = []  # (kind, start, end) of side ops' own kernels
    collectives: dict[str, float] = defaultdict(float)  # side op -> its collective kernels
    on_gpu = _union([(k["ts"], k["ts"] + k.get("dur", 0)) for k in kernels
                     if any(c in k["name"] for c in DRAG_KERNELS)])
    instances: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # label -> ms, beside
    for k in kernels:
        launch = launches.get(k["args"]["correlation"])
        if launch is None:
            continue
        label = _owner_at(owner.get(thread_of(launch), []), launch["ts"])
        if label and label.startswith(SIDE_OP):
            if any(c in k["name"] for c in COLLECTIVE_KERNELS):
                collectives[label] += k.get("dur", 0) / 1e3
            else:
                stream, _, op = label[len(SIDE_OP):].partition(":")
                side.append((op_kind(Interval(stream, op.rpartition("#")[0], 0, 0)), k["ts"],
                             k["ts"] + k.get("dur", 0)))
        elif label:
            start, end = k["ts"], k["ts"] + k.get("dur", 0)
            phases[phase_class(label)][2] += (end - start) / 1e3
            compute.append((start, end, launch["ts"]))
            instances[label][0] += (end - start) / 1e3
            instances[label][1] += _overlap(on_gpu, start, end) / 1e3
    per_class: dict[str, list[float]] = defaultdict(list)
    for key, ms in collectives.items():
        per_class[phase_class(key.rpartition("#")[0].split(":", 2)[2])].append(ms)
    blocked: dict[str, float] = defaultdict(float)
    for launch in launches.values():
        if launch.get("dur", 0) > BLOCKED_US and launch["name"].startswith(QUEUED_CALLS):
            label = _owner_at(owner.get(thread_of(launch), []),
                              launch["ts"])
            if label and not label.startswith(SIDE_OP):
                blocked[phase_class(label)] += launch["dur"] / 1e3
    for cls, ms in blocked.items():
        phases[cls][1] = max(0.0, phases[cls][1] - ms)
    return TracePhases(dict(phases), dict(side_host), span, exclusive_shares(side, compute),
                       dict(per_class), dict(blocked),
                       [(phase_class(label), *v) for label, v in instances.items()])


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint cover of ``spans``."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(union: list[tuple[float, float]], start: float, end: float) -> float:
    """Time of [start, end) within ``union`` (``_union``'s)."""
    i = max(0, bisect.bisect_right(union, (start, float("inf"))) - 1)
    total = 0.0
    while i < len(union) and union[i][0] < end:
        total += max(0.0, min(end, union[i][1]) - max(start, union[i][0]))
        i += 1
    return total


def collective_drag(steps: list[TracePhases]) -> dict[str, float]:
    """Per phase class, the share of its compute's speed lost while a collective kernel
    runs beside it (``CostModel.drag``): over its instances in ``steps`` (the blocks of a
    model: the same kernels), the least-squares slope of an instance's device ms over its
    ms beside collective kernels (``DRAG_KERNELS``; at speed ``1 - d`` for ``o`` of its
    ms, an instance takes ``d * o`` ms longer). A class needs ``MIN_INSTANCES``
    instances and ``MIN_BESIDE_MS`` of overlap between them, else it gets none."""
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for step in steps:
        for cls, ms, beside in step.instances:
            points[cls].append((beside, ms))
    drag = {}
    for cls, xy in points.items():
        mean_x = statistics.fmean(x for x, _ in xy)
        sxx = sum((x - mean_x) ** 2 for x, _ in xy)
        if len(xy) < MIN_INSTANCES or sum(x for x, _ in xy) < MIN_BESIDE_MS or sxx <= 0:
            continue
        mean_y = statistics.fmean(y for _, y in xy)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in xy) / sxx
        drag[cls] = min(MAX_DRAG, max(0.0, slope))
    return drag


def unprofiled_busy_ms(steps: list[list[list]]) -> dict[str, float]:
    """Per collective kind, the stream time of its ops in ``bench step``'s steps without
    the profiler (``side_ms`` of each: ``[stream, label, ms]``, timing events around each
    op's work), each op (by stream, label and occurrence) the median over the steps. On
    real NCCL the profiled step's collectives can differ a lot: in one 1x2 run, with the
    ranks further apart under the profiler, its reduce-scatters took 3.4-4.5 ms, waiting
    for the other rank, against about 1 ms without it."""
    per_op: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for side_ms in steps:
        seen: Counter[tuple[str, str]] = Counter()
        for stream, label, ms in side_ms:
            per_op[(stream, label, seen[(stream, label)])].append(ms)
            seen[(stream, label)] += 1
    out: dict[str, float] = defaultdict(float)
    for (stream, label, _), times in per_op.items():
        kind = op_kind(Interval(stream, label, 0, 0))
        if kind != "other":
            out[kind] += statistics.median(times)
    return dict(out)


def least_over_ranks(ranks: list[list[list[list]]]) -> list[list[list]]:
    """Per recorded step, each side op's stream time (``side_ms``: ``[stream, label,
    ms]``) the least over the ranks (``ranks[r]``: rank r's steps; every rank issues the
    same ops). On real NCCL a collective's time holds its wait for the last rank to
    arrive, who waited for nobody."""
    out = []
    for steps in zip(*ranks, strict=True):
        if any([op[:2] for op in s] != [op[:2] for op in steps[0]] for s in steps):
            raise ValueError("side_ms: the ranks recorded different side ops")
        out.append([[*ops[0][:2], min(op[2] for op in ops)] for ops in zip(*steps)])
    return out


def peer_wait_ms(measured: TracePhases) -> dict[str, float]:
    """Per collective kind, the time its kernels spent beyond the fastest of their class
    (ops of same-sized units): on real NCCL a kernel also spans the wait for the other
    ranks to arrive (one rank's trace; a rank behind on the host makes nearly every
    collective of the one ahead wait: in one 1x2 run, 8 of 9 reduce-scatters took 3.4-4.5
    ms, the other 1.1 ms, as every one of another run of the same code), which is no
    transfer time."""
    out: dict[str, float] = defaultdict(float)
    for cls, times in measured.collectives.items():
        out[op_kind(Interval("", cls, 0, 0))] += sum(t - min(times) for t in times)
    return dict(out)


def least_device_time(steps: list[TracePhases]) -> TracePhases:
    """The first profiled step's phases, each class's device ms without what the
    collective kernels beside it cost it (``collective_drag`` over ``steps``: the drag
    times its kernels' overlap with them), the least over ``steps`` that ran it as many
    times: a kernel slowed down otherwise (by the profiler) is only ever slower. Per side
    op kind, the largest share held up over ``steps`` (``exclusive``: a profiled step
    whose host fell behind the GPU hides it; in one emulated 2x1 run the reduce-scatter's
    casts held compute up for 0.0, 0.0 and 0.63 of their time). The rest is the first
    step's, whose metrics the JSON holds; ``drag`` is the steps' own."""
    drag = collective_drag(steps)

    def own_ms(step: TracePhases) -> dict[str, float]:
        beside: dict[str, float] = defaultdict(float)
        for cls, _, ms in step.instances:
            beside[cls] += ms
        return {c: v[2] - drag.get(c, 0.0) * beside[c] for c, v in step.phases.items()}

    first = steps[0]
    phases = {c: list(v) for c, v in first.phases.items()}
    for c, ms in own_ms(first).items():
        phases[c][2] = ms
    for step in steps[1:]:
        for c, ms in own_ms(step).items():
            if c in phases and phases[c][0] == step.phases[c][0]:
                phases[c][2] = min(phases[c][2], ms)
    exclusive = {k: max(s.exclusive.get(k, 0.0) for s in steps)
                 for k in {k for s in steps for k in s.exclusive}}
    return dataclasses.replace(first, phases=phases, drag=drag, exclusive=exclusive)


def with_host_marks(measured: TracePhases, steps: list[list[list]]) -> TracePhases:
    """``measured`` (profiled steps) with its host times replaced by those of steps
    without the profiler (``bench step``'s host marks, one list per step: ``[thread,
    name, start us, duration us]``, named as the trace's annotations): the profiler slows
    the host down unevenly (per op it records), so no single scale maps one onto the
    other. Each phase class's host ms, each side op's (by name and occurrence) and the
    step's host span are the median over the steps: one step's hiccup moves none. A class
    whose launch calls waited for the GPU keeps no more host ms than the trace's outside
    them; the rest of its median is its time blocked in them (``blocked_ms``)."""
    hosts: list[dict[str, list[float]]] = []
    side: dict[tuple[str, int], list[float]] = defaultdict(list)
    spans: list[float] = []
    for marks in steps:
        threads: dict[int, list[dict]] = defaultdict(list)
        for thread, name, ts, dur in marks:
            threads[thread].append({"name": name, "ts": ts, "dur": dur})
        host: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        spans.append(max((_thread_spans(events, host, defaultdict(list))[1]
                          for events in threads.values()), default=0.0))
        hosts.append(host)
        seen: Counter[str] = Counter()
        for e in (e for events in threads.values() for e in events):
            if e["name"].startswith(SIDE_OP):
                side[(e["name"], seen[e["name"]])].append(e["dur"] / 1e3)
                seen[e["name"]] += 1
    phases = {c: [v[0], statistics.median(h[c][1] if c in h else 0.0 for h in hosts), v[2]]
              for c, v in measured.phases.items()}
    blocked = {}
    for c in measured.blocked_ms:
        # no more than the trace's host time outside those calls; the rest waited for the
        # GPU here too (the unprofiled host runs further ahead of it: one emulated 2x1
        # optimizer spent 46 ms so, against 21 ms in the profiled steps)
        phases[c][1], blocked[c] = (min(phases[c][1], measured.phases[c][1]),
                                    max(0.0, phases[c][1] - measured.phases[c][1]))
    side_host: dict[str, list[float]] = defaultdict(list)
    for (name, _), times in side.items():
        side_host[_side_class(name)].append(statistics.median(times))
    return dataclasses.replace(measured, phases=phases, side_host_ms=dict(side_host),
                               span_ms=statistics.median(spans), blocked_ms=blocked)


def exclusive_shares(side: list[tuple[str, float, float]],
               compute: list[tuple[float, float, float]]) -> dict[str, float]:
    """Per side-op kind, the share of its own kernels' time during which compute stood
    still with its next kernel already launched: held up (not merely idle, e.g. waiting
    for the host, as in a profiled host-bound step)."""
    held: list[tuple[float, float]] = []  # compute gaps with the next kernel launched
    ordered = sorted(compute)
    for (_, end, _), (start, _, launch) in zip(ordered, ordered[1:]):
        if start > max(end, launch):
            held.append((max(end, launch), start))
    starts = [a for a, _ in held]
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for kind, a, b in side:
        i, stood = max(0, bisect.bisect_right(starts, a) - 1), 0.0
        while i < len(held) and held[i][0] < b:
            stood += max(0.0, min(b, held[i][1]) - max(a, held[i][0]))
            i += 1
        total[kind][0] += b - a
        total[kind][1] += stood
    return {k: stood / busy for k, (busy, stood) in total.items() if busy > 0}


def _thread_spans(events: list[dict], phases: dict[str, list[float]],
                  side_host: dict[str, list[float]]) -> tuple[list[tuple[float, float, str | None]],
                                                   float]:
    """Walk one thread's marks and side ops in time order: add host ms per phase class,
    count instances, collect side-op host times; return the spans (start, end, and the
    side op's name inside one, else the phase, None outside every phase) and the step's
    host span (ms)."""
    points = []
    for e in events:
        name, ts, dur = e["name"], e["ts"], e.get("dur", 0)
        if name.startswith(SIDE_OP):  # one op per annotation (labels repeat per microbatch)
            key = f"{name}#{ts}"
            points += [(ts, 1, "side+", key), (ts + dur, 0, "side-", key)]
            side_host[_side_class(name)].append(dur / 1e3)
        else:
            kind, _, label = name[len(MARK):].partition(":")
            points.append((ts, 2, kind, label))
    points.sort(key=lambda p: (p[0], p[1]))
    stack: list[str] = []
    sides: list[str] = []  # the side ops being issued, innermost last
    spans: list[tuple[float, float, str | None]] = []
    first = last = None
    prev = points[0][0] if points else 0.0
    for ts, _, kind, label in points:
        if ts > prev:
            if sides:
                spans.append((prev, ts, sides[-1]))
            else:
                current = stack[-1] if stack else None
                spans.append((prev, ts, current))
                if current is not None:
                    phases[phase_class(current)][1] += (ts - prev) / 1e3
        prev = ts
        if kind == "side+":
            sides.append(label)
        elif kind == "side-":
            sides.remove(label)
        elif kind == "begin":
            stack.append(label)
            phases[phase_class(label)][0] += 1
            first = ts if first is None else first
        elif kind == "end":
            if label in stack:
                del stack[len(stack) - 1 - stack[::-1].index(label)]
            if phase_kind(label) == "OPTIMIZER":
                last = ts
    span = (last - first) / 1e3 if first is not None and last is not None else 0.0
    return spans, span


def _side_class(name: str) -> str:
    """``side_class`` of a side op's annotation, "hsdp:<stream>:<label>"."""
    stream, _, label = name[len(SIDE_OP):].partition(":")
    return side_class(stream, label)


def _owner_at(spans: list[tuple[float, float, str | None]], ts: float) -> str | None:
    i = bisect.bisect_right(spans, (ts, float("inf"))) - 1
    return spans[i][2] if i >= 0 and spans[i][0] <= ts < spans[i][1] else None
