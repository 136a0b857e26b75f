"""``bench step``'s ``-graph`` schedules: an hsdp schedule whose step is captured in CUDA
graphs and replayed (docs/guide/cuda_graphs.md).

The first ``EAGER_STEPS`` steps of such a trainee run eagerly (the first creates the
optimizer state and the gradient buffers, which stay set: ``zero_grad(set_to_none=False)``;
hsdp checks the new state at the second, outside any graph); the third captures,
once with the emulated delays on and once off (a sleep kernel's length is fixed at
capture), forward + backward of every microbatch in one graph and the optimizer step with
the clearing of gradients in another, all from one private memory pool; every step from
then on copies the tokens into the captured inputs and replays the two graphs.

A profiled replay: the profiler sees the kernels a graph launches, but not hsdp's
annotations (the host code that made them ran once, at capture), so the trace's kernels
cannot be tied to their ops as ``hsdp_tools.bench.trace`` does, nor by CUDA stream (a replay
runs a graph's branches on streams of its own). Under emulation each collective is a sleep
kernel of its modelled duration at capture: ``intervals`` gives a sleep kernel the op of
the captured collective whose duration it matches, and every other kernel, memcpy and
memset counts as compute (a side stream's casts and copies included). A sleep kernel counts
SM cycles, calibrated on an idle GPU: beside compute the clock drops and it runs up to
``STRETCH`` longer (11 % seen on an H200), never shorter, so it is matched to the longest
captured duration it reaches. A unit's inner all-gather and reduce-scatter move the same
bytes, hence last the same: both read as the all-gather (inner busy time is their union).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hsdp.sharding.comm import Collectives
from hsdp_tools.bench.intercept import op_names
from hsdp_tools.report.chrome_trace import load_chrome_trace, read_events
from hsdp_tools.report.metrics import Interval

if TYPE_CHECKING:
    from hsdp_tools.bench.trainee import Trainee

EAGER_STEPS = 2  # steps before the capture
SLEEP_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel
STRETCH = 0.25  # how much longer than modelled a sleep kernel may run beside compute
SHORTER = 0.02  # how much shorter (timer resolution)


class GraphedSteps:
    """Capture and replay of one trainee's step (module docstring). ``collectives``: the
    model's root collectives (a ``DelayedCollectives`` under emulation), whose calls at
    capture are kept with their modelled durations."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.graphs: dict[bool, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        self.inputs: list[torch.Tensor] = []
        self.captured: list[tuple[str, str, float]] = []  # (stream, label, seconds)
        self.step_bytes: dict[str, int] = {}  # the collectives' bytes of one replay
        self.pool_bytes = 0  # memory the captures reserved (the graphs' pool)
        self._logging = False
        before = collectives.before

        def logged(kind: str, axis: str, nbytes: int, group_size: int) -> None:
            fabric = getattr(collectives, "fabric", None)
            if self._logging and fabric is not None and kind in ("all_gather",
                                                                "reduce_scatter",
                                                                "all_reduce"):
                self.captured.append((*op_names(kind, axis),
                                      fabric.seconds(kind, axis, nbytes, group_size)))
            before(kind, axis, nbytes, group_size)

        collectives.before = logged

    def step(self, t: Trainee, batches: list[torch.Tensor], delays: bool,
             mark: Callable[[str], None]) -> float:
        """One replayed step of ``t`` (captured first if need be); the host time (s)."""
        if not self.graphs:
            self._capture(t, batches)
        t0 = time.perf_counter()
        for inp, tokens in zip(self.inputs, batches, strict=True):
            inp.copy_(tokens)
        forward_backward, update = self.graphs[delays]
        forward_backward.replay()
        mark("forward")
        mark("backward")
        update.replay()
        mark("optimizer")
        host = time.perf_counter() - t0
        t.drain()
        for key, n in self.step_bytes.items():
            t.collective_bytes[key] = t.collective_bytes.get(key, 0) + n
        return host

    def _capture(self, t: Trainee, batches: list[torch.Tensor]) -> None:
        """Both graphs with the delays on and off, from one pool (they never run at once).
        The captures issue the collectives' bytes twice without running them: the bytes of
        one step are kept and added at each replay instead."""
        torch.cuda.synchronize()
        self.inputs = [b.clone() for b in batches]
        counted = dict(t.collective_bytes)
        reserved = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for delays in (True, False):
            self._logging = delays
            with t.comm(delays):
                forward_backward, update = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(forward_backward, pool=pool):
                    t.forward_backward(self.inputs)
                with torch.cuda.graph(update, pool=pool):
                    t.update()
            self.graphs[delays] = forward_backward, update
            if delays:
                self.step_bytes = {k: n - counted.get(k, 0)
                                   for k, n in t.collective_bytes.items()}
        self._logging = False
        t.collective_bytes.clear()
        t.collective_bytes.update(counted)
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - reserved

    def intervals(self, trace: dict | str | Path) -> list[Interval]:
        """The profiled replay's intervals (module docstring)."""
        return replay_intervals(trace, self.captured)


def replay_intervals(trace: dict | str | Path,
                     captured: list[tuple[str, str, float]]) -> list[Interval]:
    """A replayed step's GPU events as ``Interval``s: a sleep kernel as the captured
    collective (stream, label, seconds) of the longest duration within ``[dur / (1 +
    STRETCH), dur * (1 + SHORTER)]``; anything else as compute (module docstring)."""
    if not isinstance(trace, dict):
        trace = load_chrome_trace(trace)
    out = []
    for e in read_events(trace, ()).gpu:
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        name = e.get("name", "")
        stream, label = "compute", name
        if SLEEP_KERNEL in name:
            fits = [c for c in captured
                    if dur / (1 + STRETCH) <= c[2] * 1e6 <= dur * (1 + SHORTER)]
            if fits:
                stream, label, _ = max(fits, key=lambda c: c[2])
        out.append(Interval(stream, label, start, start + dur))
    return sorted(out, key=lambda iv: (iv.start_us, iv.stream))
