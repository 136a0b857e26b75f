"""The simulator's virtual clock: streams that record a ``Program`` instead of running
anything, and its evaluation on a virtual clock.

``VirtualBackend`` plugs into the runtime's ``Streams`` (``hsdp.streams.stream_set``): every call of
the schedule is appended to a ``Program`` (a side op's ``fn`` runs at once, on meta
tensors, and reports its collectives' sizes), which ``Program.evaluate`` then times with
a cost model (``evaluate_ranks``: every rank at once). The schedule code is the same as
on CUDA and CPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hsdp.streams.contract import (
    STREAM_NAMES,
    ComputeStream,
    Event,
    OpRecord,
    SideStream,
    StreamBackend,
    Tracer,
)
from hsdp.streams.stream_set import Streams


@dataclass(slots=True)
class ProgramOp:
    """One host action of a ``Program``, in issue order.

    ``kind``: ``"compute"`` (one compute op; ``payload`` is what a cost model prices),
    ``"side"`` (an op of side stream ``stream``; ``payload``: its collectives as
    ``(kind, axis, nbytes, group_size)``; ``local_bytes``: what its own tensor ops, e.g. the
    cast into the all-gather buffer, read and write; ``kernel_bytes``: what its fused
    quantization passes read and write, per pass), ``"record"`` (an event at the end of the
    compute issued so far), ``"wait"`` (compute waits for op ``deps[0]``), ``"sync"`` (the
    host blocks until op ``deps[0]`` has finished), ``"begin"`` / ``"end"`` (a compute
    phase's boundaries). ``label``: the runtime's; a compute op's is its phase (the
    innermost begun and not ended; "" outside every phase), ``phase`` the index of that
    phase's ``begin`` op (-1 outside).
    """

    kind: str
    stream: str
    label: str
    deps: tuple[int, ...] = ()
    payload: Any = None
    phase: int = -1
    local_bytes: int = 0
    kernel_bytes: tuple[tuple[str, int], ...] = ()  # fused quantization passes: (pass, bytes)


@dataclass
class Timing:
    """A ``Program`` on the virtual clock (seconds): ``records`` of the ops from ``start``
    on (compute ops of one phase merged while back to back; side ops; compute waits over
    the time compute stood still; phase marks), each op's end (a ``record``'s: its event;
    a ``sync``'s: when the host resumed) and the host's busy time from ``start`` on."""

    records: list[OpRecord]
    end_s: list[float]
    host_busy_s: float


class Program:
    """What the host issued to the virtual streams, in order (see ``VirtualBackend``)."""

    def __init__(self) -> None:
        self.ops: list[ProgramOp] = []
        self._phases: list[int] = []  # begin ops of the open phases, innermost last
        self._side: list[tuple] | None = None  # collectives of the side op being issued
        self._side_bytes = 0  # bytes its own tensor ops touch
        self._side_kernels: list[tuple[str, int]] = []  # its fused quantization passes

    def add(self, kind: str, stream: str, label: str, deps: tuple[int, ...] = (),
            payload: Any = None, phase: int = -1, local_bytes: int = 0,
            kernel_bytes: tuple[tuple[str, int], ...] = ()) -> int:
        self.ops.append(ProgramOp(kind, stream, label, deps, payload, phase, local_bytes,
                                  kernel_bytes))
        return len(self.ops) - 1

    @property
    def issuing_side_op(self) -> bool:
        """True while a side stream's closure runs (its tensor ops are not compute)."""
        return self._side is not None

    def compute(self, payload: Any) -> None:
        """One compute op issued now, in the current phase."""
        phase = self._phases[-1] if self._phases else -1
        label = self.ops[phase].label if phase >= 0 else ""
        self.add("compute", "compute", label, payload=payload, phase=phase)

    def collective(self, kind: str, axis: str, nbytes: int, group_size: int) -> None:
        """``Collectives``' hook: one collective of the side op being issued."""
        if self._side is None:
            raise RuntimeError("hsdp: a collective outside a side stream has no virtual time "
                               "(host-side collectives are not simulated)")
        self._side.append((kind, axis, nbytes, group_size))

    def local(self, nbytes: int) -> None:
        """A tensor op of the side op being issued (memory bound: ``nbytes`` touched)."""
        self._side_bytes += nbytes

    def kernel(self, name: str, nbytes: int) -> None:
        """A fused quantization pass ``name`` of the side op being issued (``nbytes`` read
        and written; ``hsdp_tools.sim.quant_pricing``)."""
        self._side_kernels.append((name, nbytes))

    def begin(self, label: str) -> None:
        self._phases.append(self.add("begin", "compute", label))

    def end(self, label: str) -> None:
        self.add("end", "compute", label)
        for i in range(len(self._phases) - 1, -1, -1):
            if self.ops[self._phases[i]].label == label:
                del self._phases[i]
                break

    def side(self, stream: str, fn: Callable[[], None], after: Sequence[Event],
             label: str) -> int:
        """Run ``fn`` (the op's tensor work, on meta tensors: instant) and add the op."""
        outer = (self._side, self._side_bytes, self._side_kernels)
        self._side, self._side_bytes, self._side_kernels = [], 0, []
        try:
            fn()
            collectives, nbytes = tuple(self._side), self._side_bytes
            kernels = tuple(self._side_kernels)
        finally:
            self._side, self._side_bytes, self._side_kernels = outer
        deps = tuple(_virtual(e).index for e in after)
        return self.add("side", stream, label, deps, collectives, local_bytes=nbytes,
                        kernel_bytes=kernels)

    def evaluate(self, cost: Callable[[ProgramOp], tuple[float, ...]], start: int = 0,
                 host_blocks: bool = False, shared_sms: bool = False) -> Timing:
        """Run the program on a virtual clock. ``cost(op)`` gives (seconds the host takes to
        issue it, seconds it occupies its stream[, seconds of a side op's own tensor work,
        e.g. its casts; for a compute op, the share of its speed it loses while a
        collective kernel runs beside it, which stretches it]). An op starts once it is
        issued, its stream is free and its dependencies have finished; the host runs ahead
        of the streams except at a ``sync`` (and, with ``host_blocks``, after every op on
        compute: compute on the host thread, as on CPU). With ``shared_sms``, the side
        ops' own tensor work (half before the collective, half after) holds up compute for
        as long as it runs, as a GPU runs a large copy kernel of a side stream between two
        compute kernels; collectives themselves run beside compute."""
        return _Clock(self.ops, cost, start, host_blocks, shared_sms).run()

    def evaluate_ranks(self, costs: Sequence[Callable[[ProgramOp], tuple[float, ...]]],
                       groups: dict[str, list[list[int]]], start: int = 0,
                       host_blocks: bool = False, shared_sms: bool = False,
                       barrier: int | None = None) -> list[Timing]:
        """The program run by several ranks at once, each at its own ``costs[rank]`` (as
        ``evaluate``): every rank issues the same ops (SPMD), and a side op's collective
        on axis ``a`` starts on the ranks of its group (the one of ``groups[a]`` holding
        the rank; groups of one rank wait for nobody) once every one of them is ready for
        it. A rank that is early waits on its stream, as a collective kernel spins until
        its peers arrive; so a rank behind on the host holds up the others. Solved by
        running the ranks' clocks again with each collective's start held back to its
        group's latest readiness, until no start moves (only ever later: a fixed point).
        ``barrier``: the op before which the hosts of all ranks meet (a host barrier
        between steps, as ``bench step``'s)."""
        not_before: list[dict[int, float]] = [{} for _ in costs]
        host_from = 0.0
        # each side op and the rank groups of its collectives (none: it waits for nobody)
        synced = [(i, [g for a in _peer_axes(op) for g in groups[a]])
                  for i, op in enumerate(self.ops) if op.kind == "side"]
        for _ in range(len(self.ops) + 2):  # a round settles at least the earliest open collective
            clocks = [_Clock(self.ops, c, start, host_blocks, shared_sms, nb, barrier,
                             host_from) for c, nb in zip(costs, not_before, strict=True)]
            timings = [c.run() for c in clocks]
            reached = max(c.reached for c in clocks)
            moved = barrier is not None and reached > host_from + 1e-12
            host_from = max(host_from, reached)
            for i, op_groups in synced:
                for group in op_groups:
                    t = max(clocks[r].ready[i] for r in group)
                    for r in group:
                        if t > not_before[r].get(i, 0.0) + 1e-12:
                            not_before[r][i] = t
                            moved = True
            if not moved:
                return timings
        raise RuntimeError("hsdp: virtual clock: the ranks' collectives did not settle")


def _peer_axes(op: ProgramOp) -> set[str]:
    """The axes on which a side op's collectives have other ranks (a group of one runs
    no collective kernel and waits for nobody)."""
    return {axis for _, axis, _, size in op.payload if size > 1}


@dataclass
class _Running:
    """The compute op on the virtual GPU: when it started, its device time at full speed
    (``work``), the share of speed it loses beside a collective kernel, its last record."""

    index: int
    start: float
    work: float
    drag: float
    record: OpRecord


class _Clock:
    """``Program.evaluate``: a discrete-event run. The host issues ops in program order
    as far as it can (up to a ``sync``, or with ``host_blocks`` an op on compute, whose end
    is not known yet); then the stream work that can start earliest is started; and so on.

    ``shared_sms``: a side op runs in two steps on its stream (half of its own tensor work
    and the collective; the other half), and each half of tensor work takes the SMs when
    it is ready: a compute op running then is held up for as long, and one that becomes
    ready meanwhile waits for it (a GPU dispatches the blocks of the kernel queued first)."""

    def __init__(self, ops: list[ProgramOp], cost: Callable[[ProgramOp], tuple[float, ...]],
                 start: int, host_blocks: bool, shared_sms: bool,
                 not_before: dict[int, float] | None = None, barrier: int | None = None,
                 host_from: float = 0.0) -> None:
        self.ops, self.start = ops, start
        # the host issues op ``barrier`` no earlier than ``host_from``; ``reached``: when
        # it got there
        self.barrier, self.host_from, self.reached = barrier, host_from, 0.0
        self.not_before = not_before or {}  # side op -> its collective starts no earlier
        self.ready: dict[int, float] = {}  # side op -> when its collective could start
        self.host_blocks, self.shared_sms = host_blocks, shared_sms
        self.prices = [cost(op) for op in ops]
        self.ends: list[float | None] = [None] * len(ops)
        self.issued = [0.0] * len(ops)
        self.queues: dict[str, deque[int]] = {s: deque() for s in STREAM_NAMES}
        self.free = dict.fromkeys(STREAM_NAMES, 0.0)
        self.sms_free = 0.0  # compute ops start no earlier (a side op's tensor work)
        self.running: _Running | None = None  # the compute op on the GPU
        self.paused: list[tuple[float, float]] = []  # side ops' tensor work holding the SMs
        self.beside: list[tuple[float, float]] = []  # collective kernels on the GPU
        self.second: dict[int, tuple[float, float]] = {}  # side op -> (begin, 2nd step)
        self.records: list[tuple[int, OpRecord]] = []
        self.last_compute: tuple[int, OpRecord] | None = None

    def run(self) -> Timing:
        host, i, n = 0.0, 0, len(self.ops)
        while True:
            while i < n:  # issue
                if i == self.barrier:
                    self.reached, host = host, max(host, self.host_from)
                    self.barrier = None  # met (the loop may come back to op i)
                op, host_s = self.ops[i], self.prices[i][0]
                if op.kind == "sync":
                    end = self.ends[op.deps[0]]
                    if end is None:
                        break
                    host = self.ends[i] = max(host + host_s, end)
                elif self.host_blocks and i > 0 and self.ops[i - 1].stream == "compute":
                    end = self.ends[i - 1]
                    if end is None:
                        break
                    host = max(host, end) + host_s
                    self._issue(i, host)
                else:
                    host += host_s
                    self._issue(i, host)
                i += 1
            if not self._start_next():
                stuck = [q[0] for q in self.queues.values() if q] + ([i] if i < n else [])
                if stuck:
                    raise RuntimeError(f"hsdp: virtual clock: op {min(stuck)} waits for work "
                                       f"that can never start")
                break
        self.records.sort(key=lambda r: r[0])
        host_busy = sum(p[0] for p in self.prices[self.start:])
        return Timing([r for k, r in self.records if k >= self.start],
                      [0.0 if e is None else e for e in self.ends], host_busy)

    def _issue(self, i: int, host: float) -> None:
        self.issued[i] = host
        self.queues[self.ops[i].stream].append(i)

    def _candidate(self, stream: str) -> tuple[float, int] | None:
        """When the head of ``stream`` can start (None: nothing queued, or a dependency
        whose end is not known yet)."""
        q = self.queues[stream]
        if not q:
            return None
        i = q[0]
        if i in self.second:
            return self.second[i][1], i
        deps = [self.ends[j] for j in self.ops[i].deps]
        if None in deps:
            return None
        ready = max(self.issued[i], self.free[stream], *deps)
        if self.shared_sms and self.ops[i].kind == "compute" and self.prices[i][1] > 0:
            ready = max(ready, self.sms_free)
        return ready, i

    def _start_next(self) -> bool:
        """Start the stream work that can start first; False if none can."""
        found = [c for c in map(self._candidate, STREAM_NAMES) if c is not None]
        if not found:
            return False
        t, i = min(found)
        op = self.ops[i]
        if op.kind == "side":
            self._side(i, t)
            return True
        self.queues["compute"].popleft()
        end = t
        if op.kind == "compute":
            self.paused = [s for s in self.paused if s[1] > t]
            self.beside = [s for s in self.beside if s[1] > t]
            work, drag = self.prices[i][1], (self.prices[i][2] if len(self.prices[i]) > 2
                                             else 0.0)
            end = self._finish(t, work, drag)
            self.running = (_Running(i, t, work, drag, self._compute_record(i, op, t, end))
                            if end > t else None)
        elif op.kind == "wait":  # ``t`` already waited for the dependency
            self.records.append((i, OpRecord("compute", op.label, self.free["compute"], t)))
        elif op.kind != "record":  # begin / end: zero-length, where the compute stream stands
            self.records.append((i, OpRecord("compute", f"{op.kind}:{op.label}", t, t)))
        self.free["compute"] = self.ends[i] = end
        return True

    def _side(self, i: int, t: float) -> None:
        op, busy = self.ops[i], self.prices[i][1]
        half = (self.prices[i][2] / 2 if len(self.prices[i]) > 2 else 0.0) * self.shared_sms
        if i in self.second:  # second step: the other half of the tensor work
            self._take_sms(t, half)
            begin, end = self.second.pop(i)[0], t + half
        else:  # first step: half the tensor work, then the collective (after its peers)
            if half > 0:
                self._take_sms(t, half)
            self.ready[i] = t + half
            wait = max(0.0, self.not_before.get(i, 0.0) - self.ready[i])
            if _peer_axes(op):
                # its kernel is on the GPU from then on, waiting for its peers included
                self._slow_compute(t + half, t + wait + busy - half)
            if half > 0:
                self.second[i] = (t, t + wait + busy - half)
                return
            begin, end = t, t + wait + busy
        self.queues[op.stream].popleft()
        self.free[op.stream] = self.ends[i] = end
        self.records.append((i, OpRecord(op.stream, op.label, begin, end)))

    def _take_sms(self, t: float, seconds: float) -> None:
        """A side op's tensor work from ``t`` on: the compute op running then pauses for
        ``seconds`` (its record is split); later compute ops start after it."""
        begin = max(self.sms_free, t)
        self.sms_free = begin + seconds
        self.paused.append((begin, self.sms_free))
        run = self.running
        if run is not None and self.ends[run.index] > t:  # it stands still meanwhile
            end = self._finish(run.start, run.work, run.drag)
            run.record.end_s = max(run.record.start_s, t)
            run.record = OpRecord("compute", run.record.label, self.sms_free, end)
            self.records.append((run.index, run.record))
            self.last_compute = (run.index, run.record)
            self.ends[run.index] = self.free["compute"] = end

    def _slow_compute(self, begin: float, end: float) -> None:
        """A collective kernel on the GPU over [begin, end): the compute op running
        meanwhile goes at ``1 - drag`` of its speed (its SMs are shared)."""
        if end <= begin:
            return
        self.beside.append((begin, end))
        run = self.running
        if run is not None and run.drag > 0 and self.ends[run.index] > begin:
            run.record.end_s = self.ends[run.index] = self.free["compute"] = self._finish(
                run.start, run.work, run.drag)

    def _finish(self, start: float, work: float, drag: float) -> float:
        """When compute of ``work`` seconds at full speed, started at ``start``, ends:
        stopped while a side op's tensor work holds the SMs (``paused``), at ``1 - drag``
        of its speed while a collective kernel runs (``beside``)."""
        spans = [(a, b, 0.0) for a, b in self.paused if b > start]
        if drag > 0:
            spans += [(a, b, 1.0 - drag) for a, b in self.beside if b > start]
        if not spans or work <= 0:
            return start + work
        points = sorted({start, *(p for a, b, _ in spans for p in (a, b) if p > start)})
        left = work
        for a, b in zip(points, points[1:]):
            rate = min((r for s, e, r in spans if s <= a < e), default=1.0)
            if rate * (b - a) >= left:
                return a + left / rate
            left -= rate * (b - a)
        return points[-1] + left

    def _compute_record(self, i: int, op: ProgramOp, begin: float, end: float) -> OpRecord:
        """Compute ops of one phase merge into one record while back to back; the
        record the op is in."""
        label = op.label or "compute"
        last = self.last_compute
        if (last is not None and last[1].label == label and last[1].end_s == begin
                and (last[0] >= self.start or i < self.start)):
            last[1].end_s = end
            return last[1]
        self.last_compute = (i, OpRecord("compute", label, begin, end))
        self.records.append(self.last_compute)
        return self.last_compute[1]


class VirtualEvent(Event):
    """Completes with op ``index`` of its program; its time exists only once the program
    is evaluated."""

    def __init__(self, program: Program, index: int, label: str = "") -> None:
        self.program = program
        self.index = index
        self.label = label

    def query(self) -> bool:
        raise RuntimeError("hsdp: a virtual event has no state before its program is "
                           "evaluated; the schedule must not branch on query()")

    def synchronize(self) -> None:
        self.program.add("sync", "host", f"sync:{self.label}", (self.index,))


def _virtual(event: Event) -> VirtualEvent:
    if not isinstance(event, VirtualEvent):
        raise TypeError(f"hsdp: virtual streams got a {type(event).__name__}")
    return event


class VirtualCompute(ComputeStream):
    def __init__(self, program: Program) -> None:
        self.program = program

    def record(self) -> Event:
        return VirtualEvent(self.program, self.program.add("record", "compute", "record"))

    def wait(self, event: Event) -> None:
        ev = _virtual(event)
        self.program.add("wait", "compute", f"wait:{ev.label}", (ev.index,))

    def begin(self, label: str) -> None:
        self.program.begin(label)

    def end(self, label: str) -> None:
        self.program.end(label)


class VirtualSideStream(SideStream):
    def __init__(self, name: str, tracer: Tracer, program: Program) -> None:
        super().__init__(name, tracer)
        self.program = program

    def submit(self, fn: Callable[[], None], after: Sequence[Event] = (),
               label: str = "") -> Event:
        return VirtualEvent(self.program, self.program.side(self.name, fn, after, label),
                            label)


class VirtualBackend(StreamBackend):
    """Virtual streams that record one ``program`` (``Streams.of``)."""

    def __init__(self) -> None:
        self.program = Program()

    def compute(self, tracer: Tracer) -> ComputeStream:
        return VirtualCompute(self.program)

    def side(self, name: str, tracer: Tracer, failed: list[BaseException]) -> SideStream:
        return VirtualSideStream(name, tracer, self.program)


def virtual_streams() -> tuple[Streams, Program]:
    """Streams that record a ``Program`` instead of running anything, and that program."""
    backend = VirtualBackend()
    return Streams.of(backend), backend.program
