"""Alpha-beta cost model of the two network domains (pure).

Used to emulate collective durations on one GPU (``bench step --emulate``) and by the
simulator. Times follow the nccl-tests bus-bandwidth convention: for a group of ``n``
ranks and a full buffer of ``nbytes`` (the gathered output of an all-gather, the input of
a reduce-scatter, the buffer of an all-reduce, the input of an all-to-all), a ring moves
``(n-1)/n * nbytes`` per rank for all-gather / reduce-scatter / all-to-all and twice that
for all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AXES = ("inner", "outer")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


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


def fit_link(kind: str, group_size: int, samples: list[tuple[int, float]],
             latency_us: float) -> Link:
    """The ``Link`` whose model best reproduces measured ``samples`` (full-buffer bytes,
    seconds) of one collective ``kind`` over ``group_size`` ranks.

    With two or more sizes: latency and bus bandwidth by least squares on the relative
    error (``t = latency + moved_bytes / busbw`` is linear in both), a negative latency
    clamped to zero. Otherwise, or when the fit gives no positive bandwidth: the bandwidth
    alone, solved at the largest size with ``latency_us`` as the latency.
    """
    if group_size < 2 or not samples:
        raise ValueError(f"nothing to fit: {len(samples)} samples over {group_size} ranks")
    unit = Fabric(Link(1.0, 0.0), Link(1.0, 0.0))  # seconds at 1 GB/s, no latency
    xs = [unit.seconds(kind, "inner", b, group_size) for b, _ in samples]
    ts = [t for _, t in samples]
    ws = [1.0 / t**2 for t in ts]
    sw, sx, st = sum(ws), sum(w * x for w, x in zip(ws, xs)), sum(w * t for w, t in zip(ws, ts))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = sw * sxx - sx * sx
    if len(set(xs)) > 1 and det > 0:
        lat, inv_bw = (st * sxx - sx * sxt) / det, (sw * sxt - sx * st) / det
        if lat < 0:
            lat, inv_bw = 0.0, sxt / sxx
        if inv_bw > 0:
            return Link(1.0 / inv_bw, lat * 1e6)
    x, t = max(zip(xs, ts))
    moving = t - latency_us * 1e-6
    if moving <= 0:
        raise ValueError(f"{kind} of the largest size took {t * 1e3:.4f} ms, not more than "
                         f"the latency {latency_us} us")
    return Link(x / moving, latency_us)


def fit_collectives(data: dict, latency_us: float = 20.0) -> dict[str, Link]:
    """The links a ``bench collectives`` JSON measured, per axis of two or more ranks:
    inner from its reduce-scatters of ``size_bytes`` (the input) over the inner group,
    outer from its all-reduces of ``size_bytes / inner`` (the reduce-scatter's output) over
    the outer group (``fit_link``; ``latency_us`` where only the bandwidth fits)."""
    meta = data["meta"]
    links = {}
    for axis, kind, n, key, div in (("inner", "reduce_scatter", meta["inner"], "t_rs_ms", 1),
                                    ("outer", "all_reduce", meta["outer"], "t_ar_ms",
                                     meta["inner"])):
        if n >= 2:
            samples = [(r["size_bytes"] // div, r[key] * 1e-3) for r in data["rows"]]
            links[axis] = fit_link(kind, n, samples, latency_us)
    return links
