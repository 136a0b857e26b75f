"""Fit the cost model to a ``bench step`` run (its JSON, and the Chrome traces it names).

From the JSON alone: the achieved TFLOP/s, such that the simulated compute busy time of
the run's own setup equals the measured one (``busy_ms.by_kind.compute`` of the first
traced step), with the optimizer and the copy-in priced at the memory bandwidth.

From the traces (``traces``, one per profiled step; older JSONs: the one ``trace``), or
the phases saved from them beside the JSON (``save_phases``: a committed run keeps its
JSON, not its traces), when they have the runtime's phase marks (``hsdp.begin:<phase>``
/ ``hsdp.end:<phase>`` ranges, recorded while the step's tracer is on), per phase class
("FWD:LlamaBlock", "BWD:Llama", "COPY_IN:LlamaBlock/0", ...) and instance, from the first
trace:

- host ms: wall time on the issuing thread while the phase is the innermost open one,
  less the time inside hsdp's side-stream ops (``hsdp:<stream>:<label>`` ranges, whose
  mean is the host cost of a side op) and inside launch calls that waited for room in the
  GPU's launch queue (``BLOCKED_US``);
- device ms: the GPU time of the kernels launched meanwhile (through the launch's
  correlation id), side-stream ops' excepted, less what NCCL kernels running beside
  them cost them (``collective_drag``: the class's drag times the time its kernels
  overlapped one); per phase class, the least over the profiled steps (a kernel
  slowed down otherwise, e.g. by the profiler, is only ever slower). The drag itself
  goes to the cost model, which slows compute wherever the simulated collectives run.

The profiler slows the host down, and unevenly (it costs per op it records): when the
JSON has host marks (the phase marks and side-op submits of steps without the profiler:
``host_marks_steps``, one list per recorded step; older JSONs: one step's
``host_marks``), host times come from them instead of the trace, each phase class's and
side op's the median over the steps (so does the step's host span). Either way, when the
JSON has the unprofiled host time of the step (``t_host_ms``, a median over the timed
steps), host times are scaled by it over their step's host span (from the first phase
mark to the end of the optimizer on the main thread). Without phase marks, ``t_host_ms``
alone gives an even host cost per compute op.

Every rank: a real run's JSON also holds ranks 1..'s host marks and side-op times
(``other_ranks``). Each rank then gets its own host costs (``CostModel.peers``; device
times are rank 0's trace's), all scaled alike (``t_host_ms``, the slowest rank's, over the
slowest rank's span), and a collective's busy time is the least over the ranks (the last
to arrive waited for nobody): the simulator runs the ranks together, and the skew of
their hosts makes the waits.

Communication: per kind (inner AG, inner RS, outer), the measured busy time of the
traced step over the one simulated on the run's own fabric (the emulated one it names,
else the base cost model's) scales the fabric's times (``comm_scale``); the base cost
model's fabric stays the one simulated with. Busy times come from the JSON's
side-op stream times (timing events around each side op in steps without the profiler:
``side_ms_steps``, one list per recorded step, each op the median over the steps; older
JSONs: one step's ``side_ms``) when it has them (with every rank's, each op's the least
over the ranks), else from the first trace, where on real NCCL the time the kernels spent
waiting for the other ranks is taken out (``peer_wait_ms``). The share of each kind's
own casts and copies that held compute up (compute stood still, its next kernel
launched) is ``CostModel.exclusive``, the largest over the profiled steps (held up shows
only where the GPU ran behind the host).

These give: the achieved TFLOP/s (the simulator's FLOPs of the measured model phases
over their device time), the memory bandwidth (device time of ``OPTIMIZER`` and
``COPY_IN`` over the bytes the simulator counts for them), the host cost per compute op
(host time of every phase over the simulator's op count in them), and the measured
table itself, which prices the phases of the same model, sequence and micro-batch size
exactly (other setups use the fitted throughput and per-op costs). ``OPTIMIZER`` stays
out of the table: its cost depends on the shard, hence the mesh.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

from hsdp.topology.communicators import COMMUNICATORS
from hsdp_tools.models import config_from_dict
from hsdp_tools.sim.costs import (
    MEMORY_PHASES,
    CostModel,
    PhaseCost,
    memory_bound,
    phase_class,
    phase_kind,
    work_flops,
)
from hsdp_tools.sim.engine import Recording, Setup, evaluate, record
from hsdp_tools.sim.fabric import Fabric, Link
from hsdp_tools.sim.trace_phases import (
    TracePhases,
    find_trace,
    least_device_time,
    least_over_ranks,
    peer_wait_ms,
    read_phases,
    recorded_steps,
    trace_paths,
    unprofiled_busy_ms,
    with_host_marks,
)

SCHEDULES = {"overlap": ("hsdp", True), "serial": ("hsdp", False),
             "hfsdp": ("hfsdp", True), "hfsdp-serial": ("hfsdp", False)}


def setup_from_results(data: dict, schedule: str) -> Setup:
    """The ``Setup`` of schedule ``schedule`` of a ``bench step`` JSON."""
    if schedule not in SCHEDULES:
        raise ValueError(f"cannot simulate schedule {schedule!r} (hsdp's: "
                         f"{', '.join(SCHEDULES)})")
    meta = data["meta"]
    m = meta["model"]
    strategy, overlap = SCHEDULES[schedule]
    return Setup(config_from_dict(m), meta["mesh"]["outer"], meta["mesh"]["inner"], strategy,
                 overlap, m["microbatches"], m["mbs"], m.get("dtype", "bf16"),
                 m.get("reduce_dtype", "fp32"))


def _measured_step(rec: Recording):
    return [op for op in rec.program.ops[rec.start:] if op.kind == "compute"]


def fit_tflops(rec: Recording, busy_ms: float, mem_gbps: float) -> float:
    """TFLOP/s at which ``rec``'s simulated compute busy time is ``busy_ms``."""
    ops = _measured_step(rec)
    mem_s = sum(op.payload.nbytes for op in ops if memory_bound(op)) / (mem_gbps * 1e9)
    flops = sum(work_flops(op) for op in ops if not memory_bound(op))
    left = busy_ms * 1e-3 - mem_s
    if flops <= 0 or left <= 0:
        raise ValueError(f"cannot fit TFLOP/s: {flops:.3g} FLOPs in {busy_ms:.3f} ms of "
                         f"compute, of which {mem_s * 1e3:.3f} ms are memory-bound")
    return flops / left / 1e12


def calibrate(path: str | Path, base: CostModel, schedule: str = "overlap",
              times_from: str | None = None) -> CostModel:
    """``base`` fitted to schedule ``schedule`` of the ``bench step`` JSON at ``path``;
    the host time per step and the collectives' ``comm_scale`` to those measured for
    schedule ``times_from`` instead, when given (every schedule of a run has its own:
    emulated collectives of the same modelled time ran a few % apart between schedules
    of one run, host times up to 5 %)."""
    data = json.loads(Path(path).read_text())
    entry = data["schedules"].get(schedule)
    try:
        busy = entry["metrics"]["busy_ms"]["by_kind"]["compute"]
    except (KeyError, TypeError):
        raise ValueError(f"{path}: no traced {schedule!r} schedule to calibrate on") from None
    setup = setup_from_results(data, schedule)
    rec = record(setup)
    traces = [t for t in (find_trace(path, p) for p in trace_paths(entry)) if t is not None]
    measured = least_device_time([read_phases(t) for t in traces]) if traces else None
    host_ms = (data["schedules"].get(times_from) or {} if times_from else entry).get(
        "t_host_ms")
    ranks = _every_rank(measured, entry)
    if not ranks or not ranks[0].phases:
        costs = dataclasses.replace(base, tflops=fit_tflops(rec, busy, base.mem_gbps))
        if host_ms:
            costs = dataclasses.replace(costs, host_us_per_op=host_ms * 1e3 / len(
                _measured_step(rec)), host_us_per_side_op=0.0)
    else:
        # Launch calls that waited for the GPU are in the host time of the step too.
        blocked = sum(ranks[0].blocked_ms.values())
        if host_ms:
            host_ms = max(host_ms - blocked, 1e-3)
        ranks = [dataclasses.replace(m, span_ms=max(m.span_ms - sum(m.blocked_ms.values()), 0.0))
                 for m in ranks]
        slowest = max(m.span_ms for m in ranks)
        models = []
        for m in ranks:
            # Every rank's marks scale alike (the tracer's cost): the timed steps' host
            # time (the slowest rank's) over the slowest rank's recorded span.
            own_ms = host_ms * m.span_ms / slowest if host_ms and slowest > 0 else None
            model = dataclasses.replace(_with_trace(base, rec, m, own_ms),
                                        phases_key=setup.phase_key())
            models.append(host_between_phases(model, rec, own_ms) if own_ms else model)
        costs = dataclasses.replace(models[0], peers=tuple(models[1:]))
        measured = ranks[0]
    # the collectives' busy times of rank 0 alone (those of the run are without the
    # waits for other ranks when the run has every rank's times: measured_busy_ms)
    own = dataclasses.replace(costs, comm_scale={}, peers=(),
                              fabric=fabric_of(data["meta"], base.fabric))
    if times_from not in (None, schedule):
        rec = record(setup_from_results(data, times_from))
    if data["meta"].get("emulate") is False:
        # Real NCCL: a collective's time also holds its wait for the other ranks (see
        # measured_busy_ms); with another schedule's times, each kind takes the lesser of the two.
        runs = [measured_busy_ms(path, data, name, traced=measured if name == schedule else None)
                for name in {schedule, times_from or schedule}]
        busy_ms = {k: min(r[k] for r in runs if k in r) for k in runs[0]}
    else:  # emulated: no peers to wait for; the schedule's unprofiled steps if it has them
        busy_ms = measured_busy_ms(path, data, times_from or schedule, emulated=True)
    scale = _comm_scale(evaluate(rec, own).metrics, busy_ms)
    return dataclasses.replace(costs, comm_scale=scale, peers=tuple(
        dataclasses.replace(p, comm_scale=scale) for p in costs.peers))


def _every_rank(traced: TracePhases | None, entry: dict) -> list[TracePhases]:
    """The profiled phases with each rank's host times: rank 0's from the entry's host
    marks, ranks 1.. from theirs (``other_ranks``; only when every rank has them); [] if
    there is no trace."""
    if traced is None:
        return []
    marks = [recorded_steps(entry, "host_marks")] + [
        recorded_steps(o, "host_marks") for o in entry.get("other_ranks") or []]
    if not marks[0]:
        return [traced]
    return [with_host_marks(traced, m) for m in (marks if all(marks) else marks[:1])]


def measured_busy_ms(path: str | Path, data: dict, name: str, emulated: bool = False,
             traced: TracePhases | None = None) -> dict[str, float]:
    """Per kind, schedule ``name``'s measured busy time: its unprofiled steps'
    (``unprofiled_busy_ms``, each op the median over them) where the JSON has them, else
    its first traced step's; on real NCCL that one less its waits for the other ranks
    (``peer_wait_ms``; ``traced``: its traces, already read), which the profiler
    exaggerates. With every rank's unprofiled steps (``other_ranks``), each op's time is
    the least over the ranks (the last to arrive waited for nobody): the simulator then
    runs the ranks together, and their skew makes the waits. With rank 0's alone, its
    waits stay in: every step of a real run has some (ranks drift apart by host jitter),
    and they stand for that skew (taking the lesser, as before, left the real rows'
    exposed communication at half the measured one)."""
    entry = data["schedules"].get(name) or {}
    busy = (entry.get("metrics") or {}).get("busy_ms", {}).get("by_kind")
    if busy is None:
        raise ValueError(f"{path}: schedule {name!r} has no measured busy times")
    steps = recorded_steps(entry, "side_ms")
    others = [recorded_steps(o, "side_ms") for o in entry.get("other_ranks") or []]
    if not emulated and others and all(others):
        steps = least_over_ranks([steps, *others])
    unprofiled = unprofiled_busy_ms(steps)
    if emulated:
        return dict(busy) | unprofiled
    if traced is None:
        trace = find_trace(path, entry.get("trace"))
        traced = read_phases(trace) if trace else None
    wait = peer_wait_ms(traced) if traced is not None else {}
    return {k: unprofiled.get(k, v - wait.get(k, 0.0)) for k, v in busy.items()}


def host_between_phases(costs: CostModel, rec: Recording, host_ms: float) -> CostModel:
    """The host time neither the phases of the trace nor its side ops cover (the runtime's
    hooks between units, issuing side-stream work): the measured host time per step less
    the simulated one, spread over the step's side-stream ops, which those hooks issue."""
    n_side = sum(op.kind == "side" for op in rec.program.ops[rec.start:])
    missing_ms = host_ms - evaluate(rec, costs).metrics["host_busy_ms"]
    if n_side == 0 or missing_ms <= 0:
        return costs
    return dataclasses.replace(
        costs, host_us_per_side_op=costs.host_us_per_side_op + missing_ms * 1e3 / n_side)


def fabric_of(meta: dict, fallback: Fabric) -> Fabric:
    """The fabric a ``bench step`` run emulated, else ``fallback`` (real collectives)."""
    f = meta.get("fabric")
    if not f:
        return fallback
    return Fabric(Link(f["inner"]["bus_gbps"], f["inner"]["latency_us"]),
                  Link(f["outer"]["bus_gbps"], f["outer"]["latency_us"]))


def _comm_scale(sim: dict, measured: dict) -> dict[str, float]:
    """Measured over simulated busy time per collective kind."""
    out = {}
    for kind in COMMUNICATORS:
        a, b = sim["busy_ms"]["by_kind"].get(kind, 0.0), measured.get(kind)
        if a > 0 and b:
            out[kind] = b / a
    return out


def _with_trace(base: CostModel, rec: Recording, measured: TracePhases,
                host_ms: float | None) -> CostModel:
    """Memory bandwidth, host costs per op and the measured table (module docstring)."""
    scale = host_ms / measured.span_ms if host_ms and measured.span_ms > 0 else 1.0
    ops = _measured_step(rec)
    instances: dict[str, set[int]] = defaultdict(set)
    n_ops: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    for op in ops:
        cls = phase_class(op.label)
        instances[cls].add(op.phase)
        n_ops[cls] += 1
        nbytes[cls] += op.payload.nbytes
    mem_ms = sum(v[2] for c, v in measured.phases.items() if phase_kind(c) in MEMORY_PHASES)
    mem_bytes = sum(b for c, b in nbytes.items() if phase_kind(c) in MEMORY_PHASES)
    model_ms = sum(v[2] for c, v in measured.phases.items()
                   if c in n_ops and phase_kind(c) not in MEMORY_PHASES)
    model_flops = sum(work_flops(op) for op in ops if phase_class(op.label) in measured.phases
                      and phase_kind(op.label) not in MEMORY_PHASES)
    host_total = sum(v[1] for c, v in measured.phases.items() if c in n_ops) * scale
    ops_total = sum(n_ops[c] for c in measured.phases if c in n_ops)
    table = {c: PhaseCost(v[1] * scale / v[0], v[2] / v[0]) for c, v in measured.phases.items()
             if v[0] > 0 and phase_kind(c) != "OPTIMIZER"}
    side = measured.side_host_ms
    return dataclasses.replace(
        base,
        tflops=model_flops / (model_ms * 1e9) if model_ms > 0 and model_flops else base.tflops,
        mem_gbps=mem_bytes / (mem_ms * 1e6) if mem_ms > 0 and mem_bytes else base.mem_gbps,
        host_us_per_op=host_total / ops_total * 1e3 if ops_total else base.host_us_per_op,
        host_us_per_side_op=0.0 if side else base.host_us_per_side_op,
        side_host_us={c: sum(t) / len(t) * scale * 1e3 for c, t in side.items()},
        phases=table, exclusive=base.exclusive | measured.exclusive,
        drag=base.drag | measured.drag)
