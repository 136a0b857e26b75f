"""The CPU backend: one worker thread per side stream; compute is the calling thread."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from hsdp.ft.errors import FaultToleranceError
from hsdp.streams.contract import (
    POLL_S,
    ComputeStream,
    Event,
    OpRecord,
    SideStream,
    StreamBackend,
    TracedMarks,
    Tracer,
)
from hsdp.topology.liveness import gone_message, is_peer_failure


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
        if isinstance(self.error, FaultToleranceError):
            raise self.error  # hsdp's own verdict (e.g. lost progress), already clear
        if self.error is not None:
            gone = gone_message() if is_peer_failure(self.error) else ""
            raise StreamFailure(
                f"hsdp: {self.label or 'an operation'} on a communication stream failed: "
                f"{self.error!r}. {gone + ' ' if gone else ''}"
                f"If a collective timed out, a peer rank died, is stuck, or "
                f"ran a different sequence of hsdp operations (e.g. another number of "
                f"microbatches); hsdp's communicators cannot be used any more: restart the "
                f"job (or destroy and re-create the process groups).") from self.error


_DONE = ThreadEvent("done")
_DONE.set()


class InlineCompute(TracedMarks, ComputeStream):
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


class ThreadBackend(StreamBackend):
    def compute(self, tracer: Tracer) -> ComputeStream:
        return InlineCompute(tracer)

    def side(self, name: str, tracer: Tracer, failed: list[BaseException]) -> SideStream:
        return ThreadSideStream(name, tracer, failed)

