"""Alpha-beta cost model of the two network domains (pure).

Used to emulate collective durations on one GPU (``bench step --emulate``) and by the
simulator. Times follow the nccl-tests bus-bandwidth convention: for a group of ``n``
ranks and a full buffer of ``nbytes`` (the gathered output of an all-gather, the input of
a reduce-scatter, the buffer of an all-reduce), a ring moves ``(n-1)/n * nbytes`` per rank
for all-gather / reduce-scatter and twice that for all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AXES = ("inner", "outer")
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Link:
    """One axis of the fabric: bus bandwidth in GB/s (1e9 bytes/s) and latency in us."""

    bus_gbps: float
    latency_us: float = 20.0

    def __post_init__(self) -> None:
        if self.bus_gbps <= 0 or self.latency_us < 0:
            raise ValueError(f"invalid link {self}")


@dataclass(frozen=True)
class Fabric:
    """Per-axis links. Defaults: NVLink-class inner, 400 Gb/s InfiniBand-class outer."""

    inner: Link = field(default_factory=lambda: Link(370.0))
    outer: Link = field(default_factory=lambda: Link(47.0))

    def seconds(self, kind: str, axis: str, nbytes: int, group_size: int) -> float:
        """Modelled duration of one collective; 0 for a group of one rank."""
        if kind not in KINDS or axis not in AXES:
            raise ValueError(f"unknown collective {kind!r} on axis {axis!r}")
        if group_size <= 1:
            return 0.0
        link = self.inner if axis == "inner" else self.outer
        factor = (group_size - 1) / group_size * (2.0 if kind == "all_reduce" else 1.0)
        return link.latency_us * 1e-6 + factor * nbytes / (link.bus_gbps * 1e9)
