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
- A backend the tools plug in (``StreamBackend``; the simulator's virtual streams,
  ``hsdp.sim.clock``): the schedule code is the same as on CUDA and CPU.

The runtime also tells the compute stream which phase its work belongs to
(``begin(label)`` / ``end(label)``, nested: "FWD:<unit>", "BWD:<unit>", "COPY_IN:<group>",
...): the simulator's backend prices compute by phase; CUDA and CPU only trace the marks.

The compute stream is the caller's: CUDA's current stream, or the calling thread on CPU.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

STREAM_NAMES = ("compute", "ag", "rs", "outer")
SIDE_NAMES = STREAM_NAMES[1:]
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
        and a tool's streams memory is not reused early)."""
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


# --------------------------------------------------------------------------- set


class StreamBackend(ABC):
    """Makes the streams of one set: CUDA streams, CPU worker threads, or streams a tool
    plugs in (``Streams.of``)."""

    @abstractmethod
    def compute(self, tracer: Tracer) -> ComputeStream:
        """The set's compute stream."""

    @abstractmethod
    def side(self, name: str, tracer: Tracer, failed: list[BaseException]) -> SideStream:
        """Side stream ``name``; ``failed``, shared by the set, holds its first failure."""


class CudaBackend(StreamBackend):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def compute(self, tracer: Tracer) -> ComputeStream:
        return CudaCompute(tracer, self.device)

    def side(self, name: str, tracer: Tracer, failed: list[BaseException]) -> SideStream:
        return CudaSideStream(name, tracer, self.device)


class ThreadBackend(StreamBackend):
    def compute(self, tracer: Tracer) -> ComputeStream:
        return InlineCompute(tracer)

    def side(self, name: str, tracer: Tracer, failed: list[BaseException]) -> SideStream:
        return ThreadSideStream(name, tracer, failed)


@dataclass
class Streams:
    """The four named streams of docs/design.md ("Streams and communicators")."""

    compute: ComputeStream
    ag: SideStream
    rs: SideStream
    outer: SideStream
    tracer: Tracer
    failed: list[BaseException] = field(default_factory=list)  # CPU: see ThreadSideStream

    @staticmethod
    def of(backend: StreamBackend, tracer: Tracer | None = None) -> Streams:
        """A set of ``backend``'s streams."""
        tracer = tracer or Tracer()
        failed: list[BaseException] = []
        return Streams(backend.compute(tracer),
                       *(backend.side(name, tracer, failed) for name in SIDE_NAMES),
                       tracer, failed)

    @staticmethod
    def create(device: torch.device, tracer: Tracer | None = None) -> Streams:
        """CUDA streams on a CUDA ``device``, else CPU worker threads."""
        backend = CudaBackend(device) if device.type == "cuda" else ThreadBackend()
        return Streams.of(backend, tracer)

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
