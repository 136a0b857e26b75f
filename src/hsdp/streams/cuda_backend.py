"""The CUDA backend: hsdp's side streams are CUDA streams; compute is the current stream.
Under CUDA graph capture, events, waits and side streams follow ``capture.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch

from hsdp.streams.capture import CaptureScope, capture_refusal
from hsdp.streams.contract import (
    ComputeStream,
    Event,
    OpRecord,
    SideStream,
    StreamBackend,
    TracedMarks,
    Tracer,
    trace_mark,
    trace_wait,
)


class CudaEvent(Event):
    """``epoch``: the capture it was recorded in (None: eager; ``capture.py``)."""

    def __init__(self, stream: torch.cuda.Stream, label: str = "",
                 epoch: int | None = None) -> None:
        self.label = label
        self.epoch = epoch
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def query(self) -> bool:
        self._refuse_in_capture("a query of")
        return self.event.query()

    def synchronize(self) -> None:
        self._refuse_in_capture("a host wait for")
        self.event.synchronize()

    def _refuse_in_capture(self, what: str) -> None:
        if torch._C._cuda_isCurrentStreamCapturing():
            raise capture_refusal(
                f"{what} hsdp's stream work ({self.label or 'an event'})",
                "run it outside the captured region")


def _current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)`` without its generic device-argument handling
    (an environment read and several calls: about 10-20 us, over a hundred times a
    step, on the host's critical path)."""
    sid, dev, dtype = torch._C._cuda_getCurrentStream(index)
    return torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=dtype)


class CudaCompute(TracedMarks, ComputeStream):
    """The current stream of hsdp's device. Its index is given explicitly: the current
    stream of another current device would be the wrong one, and looking the current
    device up costs host time on every event."""

    def __init__(self, tracer: Tracer, device: torch.device, scope: CaptureScope,
                 sides: list[CudaSideStream]) -> None:
        self.tracer = tracer
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.scope = scope
        self.sides = sides  # the set's side streams (joined captures)

    def record(self) -> Event:
        return CudaEvent(_current_stream(self.index), epoch=self.scope.current)

    def capturing(self) -> bool:
        capturing = torch._C._cuda_isCurrentStreamCapturing()
        if not capturing and not self.scope.active:
            return False
        joined = [s for s in self.sides if s.joined == self.scope.epoch]
        still = not joined or joined[0].capturing()
        return self.scope.sync(capturing, _current_stream(self.index).stream_id, still)

    def begin(self, label: str) -> None:
        self._mark("begin", label)

    def end(self, label: str) -> None:
        self._mark("end", label)

    def _mark(self, kind: str, label: str) -> None:
        trace_mark(self.tracer, kind, label)
        if self.tracer.enabled:  # when the device gets there (``Tracer.device_marks``)
            event = torch.cuda.Event(enable_timing=True)
            event.record(_current_stream(self.index))
            self.tracer.add_marked(f"hsdp.{kind}:{label}", event)

    def wait(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        if event.epoch != self.scope.current:
            return  # done before this capture, or part of a graph replayed on compute
        trace_wait(self.tracer, self.name, event)
        _current_stream(self.index).wait_event(event.event)


class CudaSideStream(SideStream):
    def __init__(self, name: str, tracer: Tracer, device: torch.device,
                 scope: CaptureScope) -> None:
        super().__init__(name, tracer)
        # High priority: a collective should start as soon as its inputs are ready.
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self._id = (self.stream.stream_id, self.stream.device_index, self.stream.device_type)
        self.scope = scope
        self.joined: int | None = None  # the last capture this stream joined

    def capturing(self) -> bool:
        with self._current():
            return torch._C._cuda_isCurrentStreamCapturing()

    def _after(self, after: Sequence[Event]) -> list[CudaEvent]:
        """The events to wait for (``capture.py``): inside a capture, the fork from compute
        at this stream's first op in it, and only events of this capture; outside, a
        captured event stands for compute's order."""
        epoch = self.scope.current
        fork = []
        if epoch is not None and self.joined != epoch:
            self.joined = epoch
            fork = [CudaEvent(_current_stream(self.stream.device_index), "fork", epoch)]
        mine = [ev for ev in after if ev.epoch == epoch]
        if epoch is None and len(mine) < len(after):
            fork = [CudaEvent(_current_stream(self.stream.device_index), "replayed")]
        return fork + mine

    def submit(self, fn: Callable[[], None], after: Sequence[Event] = (),
               label: str = "") -> Event:
        traced = self.tracer.enabled
        t0 = time.perf_counter() if traced else 0.0
        rng = torch.profiler.record_function(f"hsdp:{self.name}:{label}") if traced else (
            nullcontext())
        after = self._after(after)
        with rng, self._current():
            for ev in after:
                trace_wait(self.tracer, self.name, ev)
                self.stream.wait_event(ev.event)
            if traced:  # its time on the stream, from when its inputs are ready
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            fn()
            event = CudaEvent(self.stream, label, self.scope.current)
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



class CudaBackend(StreamBackend):
    """The streams of one set share a ``CaptureScope``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.scope = CaptureScope()
        self.sides: list[CudaSideStream] = []

    def compute(self, tracer: Tracer) -> ComputeStream:
        return CudaCompute(tracer, self.device, self.scope, self.sides)

    def side(self, name: str, tracer: Tracer, failed: list[BaseException]) -> SideStream:
        stream = CudaSideStream(name, tracer, self.device, self.scope)
        self.sides.append(stream)
        return stream

