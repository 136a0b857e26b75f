"""The named stream set of docs/design.md and the process's shared sets, one per device."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hsdp.streams.contract import SIDE_NAMES, ComputeStream, SideStream, StreamBackend, Tracer
from hsdp.streams.cpu_backend import ThreadBackend
from hsdp.streams.cuda_backend import CudaBackend


@dataclass
class Streams:
    """The four named streams of docs/design.md ("Streams and communicators")."""

    compute: ComputeStream
    ag: SideStream
    rs: SideStream
    outer: SideStream
    tracer: Tracer
    failed: list[BaseException] = field(default_factory=list)  # CPU: see ThreadSideStream

    def fail(self, exc: BaseException) -> None:
        """A failure nothing can recover from (the streams' pending work cannot complete)."""
        self.failed.append(exc)

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


# Process-wide: one set of side streams per device, shared by every model on it.
_SHARED: dict[torch.device, Streams] = {}
