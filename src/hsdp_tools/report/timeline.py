"""Gantt-style PNG of op intervals: one subplot per schedule, one lane per stream."""

from __future__ import annotations

from pathlib import Path

from hsdp.streams.contract import STREAM_NAMES
from hsdp_tools.report.metrics import OP_KINDS, Interval, op_kind

# One colour per communicator of the op table (``OP_KINDS``), in its order.
_PALETTE = ("#4c72b0", "#55a868", "#dd8452", "#c44e52", "#8c8c8c")
COLORS = dict(zip(OP_KINDS, _PALETTE, strict=True))
LEGEND = {k: k.replace("_", " ") for k in OP_KINDS}


def plot_timeline(intervals_by_schedule: dict[str, list[Interval]], path: str | Path) -> Path:
    """Write the timeline PNG to ``path`` and return it.

    Lanes are compute, ag, rs, outer (then any other stream seen); bars are coloured by
    op kind, so an outer collective on the ``rs`` stream (serialized baseline) stands
    out. Each schedule's time axis starts at its first interval; the axes are shared so
    schedules compare at one scale.
    """
    # Lazy: matplotlib is an optional dependency. The Agg canvas on a bare Figure leaves
    # pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    names = list(intervals_by_schedule)
    if not names:
        raise ValueError("plot_timeline: no schedule to plot")
    seen = {iv.stream for ivs in intervals_by_schedule.values() for iv in ivs}
    lanes = list(STREAM_NAMES) + sorted(seen - set(STREAM_NAMES))
    fig = Figure(figsize=(12, 1.0 + 0.5 * len(lanes) * len(names)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        ivs = intervals_by_schedule[name]
        t0 = min((iv.start_us for iv in ivs), default=0.0)
        for iv in ivs:
            ax.broken_barh([((iv.start_us - t0) / 1e3, (iv.end_us - iv.start_us) / 1e3)],
                           (lanes.index(iv.stream) - 0.4, 0.8), color=COLORS[op_kind(iv)])
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_ylim(len(lanes) - 0.5, -0.5)
        ax.set_ylabel("stream")
        ax.set_title(name)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.legend(handles=[Patch(color=c, label=LEGEND[k]) for k, c in COLORS.items()],
               loc="upper right", ncol=len(COLORS))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path
