"""The stream contract: named streams and events (backends: ``cuda_backend.py``,
``cpu_backend.py``; the named set: ``stream_set.py``); CUDA streams on GPU, one worker
thread per stream on CPU.

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
  ``hsdp_tools.sim.clock``): the schedule code is the same as on CUDA and CPU.

The runtime also tells the compute stream which phase its work belongs to
(``begin(label)`` / ``end(label)``, nested: "FWD:<unit>", "BWD:<unit>", "COPY_IN:<group>",
...): the simulator's backend prices compute by phase; CUDA and CPU only trace the marks.

The compute stream is the caller's: CUDA's current stream, or the calling thread on CPU.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
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

    def watch(self, poll: Callable[[], None] | None) -> None:
        """Call ``poll`` while a wait blocks the host (None: nothing; the streams are
        shared, so a model's runtime sets it only while one of its passes runs)."""
        self.poll = poll

    @abstractmethod
    def record(self) -> Event:
        """An event that completes when compute work issued so far has finished."""

    @abstractmethod
    def wait(self, event: Event) -> None:
        """Make later compute work wait for ``event``."""

    def capturing(self) -> bool:
        """Is compute being recorded into a CUDA graph now? Called at each of hsdp's entry
        points, it also tells the streams which capture their events belong to
        (``capture.py``). Never on CPU or a tool's streams."""
        return False

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


def trace_wait(tracer: Tracer, stream: str, event: Event) -> None:
    """CUDA: a (zero-length) record of a device-side wait, in host issue order."""
    if tracer.enabled:
        now = time.perf_counter()
        tracer.add(OpRecord(stream, f"wait:{getattr(event, 'label', '')}", now, now,
                            threading.get_ident()))


def trace_mark(tracer: Tracer, kind: str, label: str) -> None:
    """A phase mark: a zero-length record, and a profiler range for trace calibration."""
    if tracer.enabled:
        now = time.perf_counter()
        tracer.add(OpRecord("compute", f"{kind}:{label}", now, now, threading.get_ident()))
        with torch.profiler.record_function(f"hsdp.{kind}:{label}"):
            pass


class TracedMarks:
    """``begin`` / ``end`` of the CUDA and CPU compute streams: trace only."""

    tracer: Tracer

    def begin(self, label: str) -> None:
        trace_mark(self.tracer, "begin", label)

    def end(self, label: str) -> None:
        trace_mark(self.tracer, "end", label)


class StreamBackend(ABC):
    """Makes the streams of one set: CUDA streams, CPU worker threads, or streams a tool
    plugs in (``Streams.of``)."""

    @abstractmethod
    def compute(self, tracer: Tracer) -> ComputeStream:
        """The set's compute stream."""

    @abstractmethod
    def side(self, name: str, tracer: Tracer, failed: list[BaseException]) -> SideStream:
        """Side stream ``name``; ``failed``, shared by the set, holds its first failure."""

