"""Named streams and events: CUDA streams on GPU, one worker thread per stream on CPU.

The schedule is written once against this interface. Work for a communication stream is
a closure handed to ``SideStream.submit(fn, after, label)``: it runs after the events in
``after`` and after everything submitted to that stream before it, and the returned event
completes when it has finished.

- CUDA: ``submit`` waits the events on the stream (device-side), runs ``fn`` on the host
  inside the stream context (kernels, allocations and frees go to that stream) and records
  an event. Nothing blocks the host.
- CPU: each stream is a worker thread; ``fn`` runs there, and its (blocking) gloo
  collectives occupy that stream only, so collectives of different streams overlap as
  kernels of different CUDA streams would. The first op that fails (a collective timed out,
  a peer died) poisons every stream of the set: later ops fail at once with that error
  instead of waiting for further timeouts, until the process groups are torn down
  (``quiesce_all``).
- Virtual (the simulator, ``Streams.virtual``): nothing runs in time; every call is
  appended to a ``Program`` (``fn`` runs at once, on meta tensors, and reports its
  collectives' sizes), which ``Program.evaluate`` then times on a virtual clock with a
  cost model: the schedule code is the same as on CUDA and CPU.

The runtime also tells the compute stream which phase its work belongs to
(``begin(label)`` / ``end(label)``, nested: "FWD:<unit>", "BWD:<unit>", "COPY_IN:<group>",
...): the virtual backend prices compute by phase; CUDA and CPU only trace the marks.

The compute stream is the caller's: CUDA's current stream, or the calling thread on CPU.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

STREAM_NAMES = ("compute", "ag", "rs", "outer")
POLL_S = 0.05


@dataclass
class OpRecord:
    """One op's host-measured lifetime on a stream (CPU backend; used by bench traces);
    on CUDA, host spans: phase marks and waits (zero-length), side-op submits
    (``submit:<label>``), with the issuing ``thread``."""

    stream: str
    label: str
    start_s: float
    end_s: float
    thread: int = 0


@dataclass
class Tracer:
    """Collects ``OpRecord``s while ``enabled``. CPU: each op's run time and each compute
    wait (its blocking time). CUDA: each op gets a profiler range instead, its host span
    (``submit:<label>``) and a pair of timing events around its work on the stream
    (``timed``; ``side_ms`` reads them once the stream is idle), and device-side waits are
    recorded as zero-length ``wait:<label>`` records in host issue order. Both: compute
    phase marks as zero-length ``begin:<label>`` / ``end:<label>`` records (and, under the
    profiler, ``hsdp.begin:<label>`` / ``hsdp.end:<label>`` ranges; on CUDA also a timing
    event on the compute stream, ``device_marks``)."""

    enabled: bool = False
    records: list[OpRecord] = field(default_factory=list)
    timed: list[tuple[str, str, Any, Any]] = field(default_factory=list)
    marked: list[tuple[str, Any]] = field(default_factory=list)  # (mark, timing event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, rec: OpRecord) -> None:
        with self._lock:
            self.records.append(rec)

    def take(self) -> list[OpRecord]:
        with self._lock:
            out, self.records = self.records, []
        return out

    def add_timed(self, stream: str, label: str, start: Any, end: Any) -> None:
        """A side op's pair of timing events (CUDA), read by ``side_ms``."""
        with self._lock:
            self.timed.append((stream, label, start, end))

    def add_marked(self, name: str, event: Any) -> None:
        """A phase mark's timing event on the compute stream (CUDA), read by
        ``device_marks``."""
        with self._lock:
            self.marked.append((name, event))

    def clear(self) -> None:
        with self._lock:
            self.records, self.timed, self.marked = [], [], []

    def side_ms(self) -> list[list]:
        """``[stream, label, ms]`` of each timed side op (CUDA), in issue order; clears
        them. Call once the streams are idle."""
        with self._lock:
            timed, self.timed = self.timed, []
        return [[name, label, start.elapsed_time(end)] for name, label, start, end in timed]

    def device_marks(self) -> list[list]:
        """``[name, ms]`` of each phase mark (CUDA), named as its host mark: when the
        compute stream reached it, from when it reached the first; clears them. Call once
        the streams are idle. Set against the host marks, they show how far the device ran
        behind the host during an unprofiled step."""
        with self._lock:
            marked, self.marked = self.marked, []
        return [[name, marked[0][1].elapsed_time(event)] for name, event in marked]


class Event(ABC):
    @abstractmethod
    def query(self) -> bool:
        """True once the work before it has finished (never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event completes; re-raise a failure of its op."""

    def wait_for(self, seconds: float) -> bool:
        """Block up to ``seconds``; True once the op has finished (or failed)."""
        deadline = time.monotonic() + seconds
        while not self.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(1e-3)
        return True


class ComputeStream(ABC):
    name = "compute"
    # CPU: called every POLL_S while a wait blocks the host; it may raise to abandon the
    # wait (another rank gave up this step). CUDA waits never block the host.
    poll: Callable[[], None] | None = None

    @abstractmethod
    def record(self) -> Event:
        """An event that completes when compute work issued so far has finished."""

    @abstractmethod
    def wait(self, event: Event) -> None:
        """Make later compute work wait for ``event``."""

    @abstractmethod
    def begin(self, label: str) -> None:
        """Compute issued from now on belongs to phase ``label`` (until ``end(label)``)."""

    @abstractmethod
    def end(self, label: str) -> None:
        """Phase ``label`` is over; compute belongs to the enclosing phase again."""


class SideStream(ABC):
    def __init__(self, name: str, tracer: Tracer) -> None:
        self.name = name
        self.tracer = tracer

    @abstractmethod
    def submit(self, fn: Callable[[], None], after: Sequence[Event] = (),
               label: str = "") -> Event:
        """Run ``fn`` on this stream after ``after``; returns its completion event."""

    def hold(self, t: torch.Tensor) -> None:
        """From inside an op of this stream: keep ``t``, allocated by another stream, from
        being reused until this stream's work issued so far is done (CUDA's caching
        allocator would hand a freed block back to its own stream at once; on CPU threads
        and virtual streams memory is not reused early)."""
        return  # nothing to do where memory is only reused once its last reference is gone


# --------------------------------------------------------------------------- CUDA


class CudaEvent(Event):
    def __init__(self, stream: torch.cuda.Stream, label: str = "") -> None:
        self.label = label
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


def _trace_wait(tracer: Tracer, stream: str, event: Event) -> None:
    """CUDA: a (zero-length) record of a device-side wait, in host issue order."""
    if tracer.enabled:
        now = time.perf_counter()
        tracer.add(OpRecord(stream, f"wait:{getattr(event, 'label', '')}", now, now,
                            threading.get_ident()))


def _trace_mark(tracer: Tracer, kind: str, label: str) -> None:
    """A phase mark: a zero-length record, and a profiler range for trace calibration."""
    if tracer.enabled:
        now = time.perf_counter()
        tracer.add(OpRecord("compute", f"{kind}:{label}", now, now, threading.get_ident()))
        with torch.profiler.record_function(f"hsdp.{kind}:{label}"):
            pass


class _TracedMarks:
    """``begin`` / ``end`` of the CUDA and CPU compute streams: trace only."""

    tracer: Tracer

    def begin(self, label: str) -> None:
        _trace_mark(self.tracer, "begin", label)

    def end(self, label: str) -> None:
        _trace_mark(self.tracer, "end", label)


def _current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)`` without its generic device-argument handling
    (an environment read and several calls: about 10-20 us, over a hundred times a
    step, on the host's critical path)."""
    sid, dev, dtype = torch._C._cuda_getCurrentStream(index)
    return torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=dtype)


class CudaCompute(_TracedMarks, ComputeStream):
    """The current stream of hsdp's device. Its index is given explicitly: the current
    stream of another current device would be the wrong one, and looking the current
    device up costs host time on every event."""

    def __init__(self, tracer: Tracer, device: torch.device) -> None:
        self.tracer = tracer
        self.index = device.index if device.index is not None else torch.cuda.current_device()

    def record(self) -> Event:
        return CudaEvent(_current_stream(self.index))

    def begin(self, label: str) -> None:
        self._mark("begin", label)

    def end(self, label: str) -> None:
        self._mark("end", label)

    def _mark(self, kind: str, label: str) -> None:
        _trace_mark(self.tracer, kind, label)
        if self.tracer.enabled:  # when the device gets there (``Tracer.device_marks``)
            event = torch.cuda.Event(enable_timing=True)
            event.record(_current_stream(self.index))
            self.tracer.add_marked(f"hsdp.{kind}:{label}", event)

    def wait(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        _trace_wait(self.tracer, self.name, event)
        _current_stream(self.index).wait_event(event.event)


class CudaSideStream(SideStream):
    def __init__(self, name: str, tracer: Tracer, device: torch.device) -> None:
        super().__init__(name, tracer)
        # High priority: a collective should start as soon as its inputs are ready.
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self._id = (self.stream.stream_id, self.stream.device_index, self.stream.device_type)

    def submit(self, fn: Callable[[], None], after: Sequence[Event] = (),
               label: str = "") -> Event:
        traced = self.tracer.enabled
        t0 = time.perf_counter() if traced else 0.0
        rng = torch.profiler.record_function(f"hsdp:{self.name}:{label}") if traced else (
            nullcontext())
        with rng, self._current():
            for ev in after:
                assert isinstance(ev, CudaEvent)
                _trace_wait(self.tracer, self.name, ev)
                self.stream.wait_event(ev.event)
            if traced:  # its time on the stream, from when its inputs are ready
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            fn()
            event = CudaEvent(self.stream, label)
        if traced:  # and the host's cost of issuing it (the simulator's calibration)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
            self.tracer.add_timed(self.name, label, start, end)
            self.tracer.add(OpRecord(self.name, f"submit:{label}", t0, time.perf_counter(),
                                     threading.get_ident()))
        return event

    def hold(self, t: torch.Tensor) -> None:
        t.record_stream(self.stream)

    @contextmanager
    def _current(self) -> Iterator[None]:
        """``torch.cuda.stream(self.stream)`` at a fraction of its host cost (it looks the
        current device and stream up through the generic, slow path, twice): this stream
        is current on its device, which is the current device, until the block ends."""
        sid, index, dtype = self._id
        device = torch._C._cuda_getDevice()
        prev = torch._C._cuda_getCurrentStream(index)
        torch._C._cuda_setStream(stream_id=sid, device_index=index, device_type=dtype)
        try:
            yield
        finally:
            torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1],
                                     device_type=prev[2])
            if device != index:  # setting a stream also made its device current
                torch._C._cuda_setDevice(device)


# --------------------------------------------------------------------------- CPU


class StreamFailure(RuntimeError):
    """An op on a communication stream failed; hsdp's communicators are unusable now."""


class ThreadEvent(Event):
    def __init__(self, label: str = "") -> None:
        self.label = label
        self._done = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait_for(self, seconds: float) -> bool:
        """Block up to ``seconds``; True once the op has finished (or failed)."""
        return self._done.wait(seconds)

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise StreamFailure(
                f"hsdp: {self.label or 'an operation'} on a communication stream failed: "
                f"{self.error!r}. If a collective timed out, a peer rank died, is stuck, or "
                f"ran a different sequence of hsdp operations (e.g. another number of "
                f"microbatches); hsdp's communicators cannot be used any more: restart the "
                f"job (or destroy and re-create the process groups).") from self.error


_DONE = ThreadEvent("done")
_DONE.set()


class InlineCompute(_TracedMarks, ComputeStream):
    """CPU compute runs on the calling thread, so its work is done when issued. Waits are
    traced as ``wait:<label of the awaited op>`` over the time they block (zero if none)."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def record(self) -> Event:
        return _DONE

    def wait(self, event: Event) -> None:
        t0 = time.perf_counter()
        while not event.wait_for(POLL_S):
            if self.poll is not None:
                self.poll()
        event.synchronize()
        if not self.tracer.enabled:
            return
        label = getattr(event, "label", "")
        self.tracer.add(OpRecord("compute", f"wait:{label}", t0, time.perf_counter()))


class ThreadSideStream(SideStream):
    """A CPU 'stream': a daemon thread running submitted closures in order. ``failed``
    is shared by the streams of one set: it holds the first error of any of them."""

    def __init__(self, name: str, tracer: Tracer, failed: list[BaseException]) -> None:
        super().__init__(name, tracer)
        self.failed = failed
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"hsdp-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], after: Sequence[Event] = (),
               label: str = "") -> Event:
        ev = ThreadEvent(label)
        self._queue.put((fn, tuple(after), label, ev))
        return ev

    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is thread-local; buffers never need grad
        while True:
            fn, after, label, ev = self._queue.get()
            try:
                if self.failed:
                    raise self.failed[0]
                for dep in after:
                    dep.synchronize()
                t0 = time.perf_counter()
                fn()
                if self.tracer.enabled:
                    self.tracer.add(OpRecord(self.name, label, t0, time.perf_counter()))
                ev.set()
            except BaseException as exc:  # surfaced to whoever waits on the event
                if not self.failed:
                    self.failed.append(exc)
                ev.set(exc)
            # Hold nothing while idle: the last closure may reference a process group,
            # which must be freed when the program drops it, not at interpreter exit
            # (a gloo group destroyed then aborted the process: "terminate called").
            fn = after = ev = None


# --------------------------------------------------------------------------- virtual


@dataclass(slots=True)
class ProgramOp:
    """One host action of a ``Program``, in issue order.

    ``kind``: ``"compute"`` (one compute op; ``payload`` is what a cost model prices),
    ``"side"`` (an op of side stream ``stream``; ``payload``: its collectives as
    ``(kind, axis, nbytes, group_size)``; ``local_bytes``: what its own tensor ops, e.g. the
    cast into the all-gather buffer, read and write), ``"record"`` (an event at the end of the
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
    """What the host issued to the virtual streams, in order (see ``Streams.virtual``)."""

    def __init__(self) -> None:
        self.ops: list[ProgramOp] = []
        self._phases: list[int] = []  # begin ops of the open phases, innermost last
        self._side: list[tuple] | None = None  # collectives of the side op being issued
        self._side_bytes = 0  # bytes its own tensor ops touch

    def add(self, kind: str, stream: str, label: str, deps: tuple[int, ...] = (),
            payload: Any = None, phase: int = -1, local_bytes: int = 0) -> int:
        self.ops.append(ProgramOp(kind, stream, label, deps, payload, phase, local_bytes))
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
        outer, self._side = (self._side, self._side_bytes), []
        self._side_bytes = 0
        try:
            fn()
            collectives, nbytes = tuple(self._side), self._side_bytes
        finally:
            self._side, self._side_bytes = outer
        deps = tuple(_virtual(e).index for e in after)
        return self.add("side", stream, label, deps, collectives, local_bytes=nbytes)

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


# --------------------------------------------------------------------------- set


@dataclass
class Streams:
    """The four named streams of docs/design.md ("Streams and communicators")."""

    compute: ComputeStream
    ag: SideStream
    rs: SideStream
    outer: SideStream
    tracer: Tracer
    program: Program | None = None  # virtual streams only
    failed: list[BaseException] = field(default_factory=list)  # CPU: see ThreadSideStream

    @staticmethod
    def create(device: torch.device, tracer: Tracer | None = None) -> Streams:
        tracer = tracer or Tracer()
        if device.type == "cuda":
            return Streams(CudaCompute(tracer, device), CudaSideStream("ag", tracer, device),
                           CudaSideStream("rs", tracer, device),
                           CudaSideStream("outer", tracer, device), tracer)
        failed: list[BaseException] = []
        return Streams(InlineCompute(tracer), ThreadSideStream("ag", tracer, failed),
                       ThreadSideStream("rs", tracer, failed),
                       ThreadSideStream("outer", tracer, failed), tracer, failed=failed)

    @staticmethod
    def virtual() -> Streams:
        """Streams that record a ``Program`` instead of running anything (the simulator)."""
        program, tracer = Program(), Tracer()
        return Streams(VirtualCompute(program), *(VirtualSideStream(n, tracer, program)
                                                  for n in ("ag", "rs", "outer")),
                       tracer, program)

    @staticmethod
    def for_device(device: torch.device) -> Streams:
        """The process's streams for ``device``, shared by every hsdp model on it. Models
        share the communicators, so their collectives must go through one queue per
        stream (on CPU, one worker thread) to be issued in the same order on every rank."""
        if device not in _SHARED:
            _SHARED[device] = Streams.create(device)
        return _SHARED[device]

    def side(self) -> tuple[SideStream, SideStream, SideStream]:
        return self.ag, self.rs, self.outer

    def drain(self) -> None:
        """Make compute wait for everything submitted to the side streams so far."""
        for s in self.side():
            # Why: callers (state dict, teardown) need every collective finished.
            self.compute.wait(s.submit(lambda: None, label="drain"))

    def quiesce(self, seconds: float) -> bool:
        """Teardown: wait up to ``seconds`` until every stream is idle, ignoring failures
        (they were reported to whoever waited on the failed op). False if some stream is
        still busy (a collective whose peer is gone: NCCL's watchdog or gloo's timeout
        ends it)."""
        deadline = time.monotonic() + seconds
        for ev in [s.submit(lambda: None, label="drain") for s in self.side()]:
            if not ev.wait_for(max(0.0, deadline - time.monotonic())):
                return False
        done = self.compute.record()
        return done.wait_for(max(0.0, deadline - time.monotonic()))


def quiesce_all(seconds: float, clear_failures: bool) -> None:
    """Wait (up to ``seconds`` in all) for every hsdp stream of the process;
    ``clear_failures``: the process groups are being torn down, so the next world's
    communicators are new."""
    deadline = time.monotonic() + seconds
    for s in _SHARED.values():
        s.quiesce(max(0.0, deadline - time.monotonic()))
        if clear_failures:
            s.failed.clear()


_SHARED: dict[torch.device, Streams] = {}
