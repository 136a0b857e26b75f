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
  kernels of different CUDA streams would.

The compute stream is the caller's: CUDA's current stream, or the calling thread on CPU.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

STREAM_NAMES = ("compute", "ag", "rs", "outer")


@dataclass
class OpRecord:
    """One op's host-measured lifetime on a stream (CPU backend; used by bench traces)."""

    stream: str
    label: str
    start_s: float
    end_s: float


@dataclass
class Tracer:
    """Collects ``OpRecord``s while ``enabled``. CPU: each op's run time and each blocking
    compute wait. CUDA: each op gets a profiler range instead, and device-side waits are
    recorded as zero-length ``wait:<label>`` records in host issue order."""

    enabled: bool = False
    records: list[OpRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, rec: OpRecord) -> None:
        with self._lock:
            self.records.append(rec)

    def take(self) -> list[OpRecord]:
        with self._lock:
            out, self.records = self.records, []
        return out


class Event(ABC):
    @abstractmethod
    def query(self) -> bool:
        """True once the work before it has finished (never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event completes; re-raise a failure of its op."""


class ComputeStream(ABC):
    name = "compute"

    @abstractmethod
    def record(self) -> Event:
        """An event that completes when compute work issued so far has finished."""

    @abstractmethod
    def wait(self, event: Event) -> None:
        """Make later compute work wait for ``event``."""


class SideStream(ABC):
    def __init__(self, name: str, tracer: Tracer) -> None:
        self.name = name
        self.tracer = tracer

    @abstractmethod
    def submit(self, fn: Callable[[], None], after: Sequence[Event] = (),
               label: str = "") -> Event:
        """Run ``fn`` on this stream after ``after``; returns its completion event."""


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
        tracer.add(OpRecord(stream, f"wait:{getattr(event, 'label', '')}", now, now))


class CudaCompute(ComputeStream):
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def record(self) -> Event:
        return CudaEvent(torch.cuda.current_stream())

    def wait(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        _trace_wait(self.tracer, self.name, event)
        torch.cuda.current_stream().wait_event(event.event)


class CudaSideStream(SideStream):
    def __init__(self, name: str, tracer: Tracer, device: torch.device) -> None:
        super().__init__(name, tracer)
        # High priority: a collective should start as soon as its inputs are ready.
        self.stream = torch.cuda.Stream(device=device, priority=-1)

    def submit(self, fn: Callable[[], None], after: Sequence[Event] = (),
               label: str = "") -> Event:
        rng = (torch.profiler.record_function(f"hsdp:{self.name}:{label}")
               if self.tracer.enabled else nullcontext())
        with rng, torch.cuda.stream(self.stream):
            for ev in after:
                assert isinstance(ev, CudaEvent)
                _trace_wait(self.tracer, self.name, ev)
                self.stream.wait_event(ev.event)
            fn()
            return CudaEvent(self.stream, label)


# --------------------------------------------------------------------------- CPU


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

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"hsdp: an operation on a communication stream failed: "
                               f"{self.error!r}") from self.error


_DONE = ThreadEvent("done")
_DONE.set()


class InlineCompute(ComputeStream):
    """CPU compute runs on the calling thread, so its work is done when issued. Waits that
    block are traced as ``wait:<label of the awaited op>``."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def record(self) -> Event:
        return _DONE

    def wait(self, event: Event) -> None:
        if not self.tracer.enabled or event.query():
            event.synchronize()
            return
        t0 = time.perf_counter()
        event.synchronize()
        label = getattr(event, "label", "")
        self.tracer.add(OpRecord("compute", f"wait:{label}", t0, time.perf_counter()))


class ThreadSideStream(SideStream):
    """A CPU 'stream': a daemon thread running submitted closures in order."""

    def __init__(self, name: str, tracer: Tracer) -> None:
        super().__init__(name, tracer)
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
                for dep in after:
                    dep.synchronize()
                t0 = time.perf_counter()
                fn()
                if self.tracer.enabled:
                    self.tracer.add(OpRecord(self.name, label, t0, time.perf_counter()))
                ev.set()
            except BaseException as exc:  # surfaced to whoever waits on the event
                ev.set(exc)


# --------------------------------------------------------------------------- set


@dataclass
class Streams:
    """The four named streams of schedule.md."""

    compute: ComputeStream
    ag: SideStream
    rs: SideStream
    outer: SideStream
    tracer: Tracer

    @staticmethod
    def create(device: torch.device, tracer: Tracer | None = None) -> Streams:
        tracer = tracer or Tracer()
        if device.type == "cuda":
            return Streams(CudaCompute(tracer), CudaSideStream("ag", tracer, device),
                           CudaSideStream("rs", tracer, device),
                           CudaSideStream("outer", tracer, device), tracer)
        return Streams(InlineCompute(tracer), ThreadSideStream("ag", tracer),
                       ThreadSideStream("rs", tracer), ThreadSideStream("outer", tracer), tracer)

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


_SHARED: dict[torch.device, Streams] = {}
