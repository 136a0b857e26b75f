"""Reading a ``torch.profiler`` Chrome trace (``prof.export_chrome_trace``): the runtime's
annotations per host thread, the launch calls by correlation id, the GPU events.

The runtime annotates each side-stream op as ``hsdp:<stream>:<label>`` (``SIDE_OP``) and
each compute phase mark as ``hsdp.begin:<phase>`` / ``hsdp.end:<phase>`` (``MARK``); a GPU
event belongs to the host code that launched it (the launch call with the same
``args.correlation``). Read by ``hsdp_tools.bench.trace`` (intervals per op) and
``hsdp_tools.sim.calibrate`` (costs per phase).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # NCCL may launch through the driver API
SIDE_OP = "hsdp:"  # hsdp:<stream>:<label>
MARK = "hsdp."  # hsdp.begin:<phase> / hsdp.end:<phase>


def load_chrome_trace(path: str | Path) -> dict:
    """Read a Chrome trace as written by ``prof.export_chrome_trace`` (``.gz`` allowed)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


@dataclass
class TraceEvents:
    """A trace's complete ("X") events that matter here."""

    annotations: dict[tuple, list[dict]]  # host thread -> its annotations of interest
    launches: dict[int, dict]  # correlation id -> launch call
    gpu: list[dict]  # kernels, memcpys and memsets, in trace order

    def launch_of(self, e: dict) -> dict | None:
        """The launch call of GPU event ``e`` (None: not in the trace, or no id)."""
        return self.launches.get((e.get("args") or {}).get("correlation"))


def read_events(trace: dict, prefixes: tuple[str, ...]) -> TraceEvents:
    """The user annotations of ``trace`` whose names start with one of ``prefixes`` (by
    host thread), its launch calls with a correlation id and its GPU events."""
    annotations: dict[tuple, list[dict]] = defaultdict(list)
    launches: dict[int, dict] = {}
    gpu: list[dict] = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat"), e.get("args") or {}
        if cat == "user_annotation" and e.get("name", "").startswith(prefixes):
            annotations[thread_of(e)].append(e)
        elif cat in LAUNCH_CATS and "correlation" in args:
            launches[args["correlation"]] = e
        elif cat in GPU_CATS:
            gpu.append(e)
    return TraceEvents(dict(annotations), launches, gpu)


def end_us(e: dict) -> float:
    """When event ``e`` ends (the trace's us)."""
    return e["ts"] + e.get("dur", 0)


def thread_of(e: dict) -> tuple:
    """The host thread of event ``e``: (pid, tid)."""
    return e.get("pid"), e.get("tid")
