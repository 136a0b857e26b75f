"""What-if grids: does overlapping the DP-outer reduction pay, and by how much?

Each row simulates the overlapped and the serialized schedule of one setup and compares
them with the lower bound of the step's work (``hsdp_tools.report.metrics.step_metrics``).
Keys that change what the runtime issues (mesh, model sizes, microbatches, dtypes,
strategy) are recorded once per combination; fabric keys only re-time the recording.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from hsdp.runtime.outer_modes import parse_mode
from hsdp.sharding.policy import Strategy
from hsdp.streams.op_table import OPS, OpKind
from hsdp.topology.communicators import COMMUNICATORS
from hsdp_tools.report.args import DTYPES
from hsdp_tools.report.table import print_table
from hsdp_tools.sim.costs import CostModel
from hsdp_tools.sim.engine import Setup, SimResult, evaluate, record
from hsdp_tools.sim.fabric import Link

# key -> (parser, applies to the recording (True) or only to the fabric (False))
KEYS = {
    "nodes": (int, True), "inner": (int, True), "seq": (int, True), "mbs": (int, True),
    "microbatches": (int, True), "reduce": (str, True), "strategy": (str, True),
    "outer_reduce": (str, True), "outer_gather": (str, True), "outer_gbps": (float, False),
    "inner_gbps": (float, False),
}
PAYS_PCT = 1.0  # a saving of at least this share of the serialized step "pays"
MARGINAL_PCT = 0.2


def parse_sweep(items: list[str]) -> dict[str, list]:
    """``["nodes=2,8", "seq=1024"]`` -> ``{"nodes": [2, 8], "seq": [1024]}``."""
    grid: dict[str, list] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or key not in KEYS or key in grid:
            raise ValueError(f"bad --sweep item {item!r}: expected KEY=V1,V2,... once per key, "
                             f"KEY among {', '.join(KEYS)}")
        try:
            grid[key] = [KEYS[key][0](v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"bad --sweep values in {item!r}") from None
        if not grid[key]:
            raise ValueError(f"bad --sweep item {item!r}: no values")
        bad = [v for v in grid[key] if (key == "reduce" and v not in DTYPES)
               or (key == "strategy" and v not in {s.value for s in Strategy})
               or (key in ("outer_reduce", "outer_gather") and not _parses(key, v))
               or (KEYS[key][0] is not str and v <= 0)]
        if bad:
            raise ValueError(f"bad --sweep values for {key}: {bad}")
    return grid


def _parses(argument: str, text: str) -> bool:
    try:
        parse_mode(argument, text)
    except ValueError:
        return False
    return True


def _gathers_outer(base: Setup, point: dict) -> bool:
    """False for a point compressing hsdp's outer parameter all-gather, which hsdp does
    not have (the sweep skips it)."""
    gather = parse_mode("outer_gather", point.get("outer_gather", base.outer_gather))
    return gather is None or point.get("strategy", base.strategy) == "hfsdp"


def _setup(base: Setup, point: dict) -> Setup:
    model = base.model
    if "seq" in point:
        model = dataclasses.replace(model, seq=point["seq"])
    changes = {"nodes": "outer", "inner": "inner", "mbs": "mbs", "microbatches": "microbatches",
               "reduce": "reduce_dtype", "strategy": "strategy", "outer_reduce": "outer_reduce",
               "outer_gather": "outer_gather"}
    return dataclasses.replace(base, model=model, **{changes[k]: v for k, v in point.items()
                                                      if k in changes})


def _costs(base: CostModel, point: dict) -> CostModel:
    f = base.fabric
    inner = Link(point.get("inner_gbps", f.inner.bus_gbps), f.inner.latency_us)
    outer = Link(point.get("outer_gbps", f.outer.bus_gbps), f.outer.latency_us)
    return dataclasses.replace(base, fabric=dataclasses.replace(f, inner=inner, outer=outer))


def run_sweep(base: Setup, costs: CostModel, grid: dict[str, list],
              progress=print) -> dict:
    """Every point of ``grid`` (a full product) on top of ``base``: the report."""
    keys = list(grid)
    rec_keys = [k for k in keys if KEYS[k][1]]
    fab_keys = [k for k in keys if not KEYS[k][1]]
    rows = []
    combos = [c for c in itertools.product(*(grid[k] for k in rec_keys))
              if _gathers_outer(base, dict(zip(rec_keys, c)))]
    if not combos:
        raise ValueError("sim sweep: outer_gather needs strategy hfsdp: no point left")
    for n, values in enumerate(combos, 1):
        point = dict(zip(rec_keys, values))
        setup = _setup(base, point)
        progress(f"sim sweep {n}/{len(combos)}: {point}")
        recs = {o: record(dataclasses.replace(setup, overlap_outer=o)) for o in (True, False)}
        for fab in itertools.product(*(grid[k] for k in fab_keys)):
            full = {**point, **dict(zip(fab_keys, fab))}
            c = _costs(costs, full)
            rows.append(row({k: full[k] for k in keys}, evaluate(recs[True], c),
                            evaluate(recs[False], c), setup))
    return {"meta": {"base": _describe(base, costs), "grid": grid}, "rows": rows}


def _describe(base: Setup, costs: CostModel) -> dict:
    return {"model": dataclasses.asdict(base.model), "mesh": [base.outer, base.inner],
            "tp": base.tp, "strategy": base.strategy, "microbatches": base.microbatches,
            "mbs": base.mbs,
            "dtype": base.dtype, "reduce_dtype": base.reduce_dtype,
            "outer_reduce": base.outer_reduce, "outer_gather": base.outer_gather,
            "costs": dataclasses.asdict(costs)}


def last_backward_ms(r: SimResult) -> float:
    """How long the last microbatch's backward takes, from the end of the last forward
    op to the end of the last backward or copy-in op (compute, or the host issuing it
    when that is slower): what the reductions can hide behind."""
    compute = [iv for iv in r.intervals if iv.stream == "compute"]
    last_fwd = max((iv.end_us for iv in compute if iv.label.startswith("FWD:")), default=0.0)
    end = max((iv.end_us for iv in compute if iv.start_us >= last_fwd
               and iv.label.startswith(("BWD:", "COPY_IN:", "RECOMPUTE:"))), default=last_fwd)
    return (end - last_fwd) / 1e3


def row(point: dict, over: SimResult, ser: SimResult, setup: Setup) -> dict:
    """One sweep row: both step times, the bound, the saving and the verdict line."""
    saving = ser.t_step_ms - over.t_step_ms
    busy = over.metrics["busy_ms"]["by_kind"]
    r = {**point, "t_overlap_ms": over.t_step_ms, "t_serial_ms": ser.t_step_ms,
         "lower_bound_ms": over.metrics["lower_bound_ms"], "saving_ms": saving,
         "saving_pct": 100.0 * saving / ser.t_step_ms, "compute_ms": busy["compute"],
         **{f"{c}_ms": busy[c] for c in COMMUNICATORS}, "host_ms": over.metrics["host_busy_ms"],
         "last_backward_ms": last_backward_ms(over), "n_microbatches": setup.microbatches}
    return {**r, **explain(r)}


def explain(r: dict) -> dict:
    """The verdict of a row and its line: the saving and the reason it is what it is."""
    host, outer, compute = r["host_ms"], r["outer_ms"], r["compute_ms"]
    rs_ms = r[f"{OPS[OpKind.REDUCE_SCATTER].communicator}_ms"]
    comm = rs_ms / r["n_microbatches"] + outer  # the last microbatch's
    backward = r["last_backward_ms"]
    if host >= 0.9 * r["t_serial_ms"]:
        why = (f"host-bound both ways (issuing the step takes {host:.1f} ms): the reductions "
               f"hide behind the host; the tail after it differs")
    elif outer >= compute:
        why = (f"the outer link carries more than compute (outer {outer:.1f} ms >= compute "
               f"{compute:.1f}); serialized, the rs stream carries both")
    elif comm > backward:
        why = (f"serialized, the last backward's RS + outer ({comm:.1f} ms) outlast it "
               f"({backward:.1f} ms)")
    else:
        why = (f"RS + outer ({comm:.1f} ms) hide behind the last backward ({backward:.1f} ms) "
               f"either way: only the tail differs")
    pct = r["saving_pct"]
    verdict = ("pays" if pct >= PAYS_PCT else "marginal" if pct >= MARGINAL_PCT
               else "does not pay")
    return {"verdict": verdict,
            "line": f"{verdict}: saves {r['saving_ms']:.1f} ms ({pct:.1f}%); {why}"}


def print_sweep(report: dict) -> None:
    keys = list(report["meta"]["grid"])
    headers = [*keys, "overlap ms", "serial ms", "bound ms", "saving ms", "saving %",
               "verdict"]
    cells = [[str(r[k]) for k in keys] + [f"{r['t_overlap_ms']:.1f}", f"{r['t_serial_ms']:.1f}",
                                         f"{r['lower_bound_ms']:.1f}", f"{r['saving_ms']:.2f}",
                                         f"{r['saving_pct']:.1f}", r["verdict"]]
             for r in report["rows"]]
    print_table("sim sweep: overlapped vs serialized outer reduction", headers, cells,
                ["bound: max(compute + last outer reduction, inner busy, outer busy)"])
    for r in report["rows"]:
        print(" ".join(f"{k}={r[k]}" for k in keys) + f": {r['line']}")


def _facets(keys: list[str], grid: dict, x: str) -> tuple[str | None, str | None]:
    """Panel rows and columns: seq and microbatches when swept, else other swept keys."""
    free = [k for k in keys if k != x and len(grid[k]) > 1]
    rows = "seq" if "seq" in free else None
    rest = [k for k in free if k != rows]
    cols = "microbatches" if "microbatches" in rest else (rest[0] if rest else None)
    return rows, cols


def plot_sweep(report: dict, path: str | Path, x: str | None = None) -> list[Path]:
    """Three PNGs: the overlap's saving (% of the serialized step; ``path``; in ms:
    ``<path>_ms``) and the step time over the lower bound (overlapped solid, serialized
    dashed; ``<path>_bound``),
    against the sweep key ``x`` (default: outer_gbps if swept, else the last key), in
    panels by sequence length (rows) and microbatches (columns) when swept, one line per
    combination of the other keys."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    grid = report["meta"]["grid"]
    keys = list(grid)
    x = x or ("outer_gbps" if "outer_gbps" in keys else keys[-1])
    frow, fcol = _facets(keys, grid, x)
    others = [k for k in keys if k not in (x, frow, fcol)]
    rvals = grid[frow] if frow else [None]
    cvals = grid[fcol] if fcol else [None]
    path = Path(path)
    outs = []
    for suffix, title in (("", "overlap's saving, % of the serialized step"),
                          ("_ms", "overlap's saving, ms per step"),
                          ("_bound", "step / lower bound (solid: overlapped, dashed: "
                                     "serialized)")):
        fig = Figure(figsize=(4 * len(cvals) + 1, 3.2 * len(rvals) + 1))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(rvals), len(cvals), squeeze=False, sharex=True)
        for i, rv in enumerate(rvals):
            for j, cv in enumerate(cvals):
                ax = axes[i][j]
                sel = [r for r in report["rows"] if (frow is None or r[frow] == rv)
                       and (fcol is None or r[fcol] == cv)]
                lines: dict[tuple, list[dict]] = {}
                for r in sel:
                    lines.setdefault(tuple(r[k] for k in others), []).append(r)
                for n, (combo, rs) in enumerate(lines.items()):
                    rs = sorted(rs, key=lambda r: r[x])
                    xs = [r[x] for r in rs]
                    label = ", ".join(f"{k}={v}" for k, v in zip(others, combo)) or None
                    color = f"C{n % 10}"
                    if suffix == "_bound":
                        ax.plot(xs, [r["t_overlap_ms"] / r["lower_bound_ms"] for r in rs],
                                "o-", color=color, label=label, ms=3)
                        ax.plot(xs, [r["t_serial_ms"] / r["lower_bound_ms"] for r in rs],
                                "x--", color=color, ms=3)
                    else:
                        key = "saving_ms" if suffix else "saving_pct"
                        ax.plot(xs, [r[key] for r in rs], "o-", color=color, label=label,
                                ms=3)
                if not suffix:
                    ax.axhline(PAYS_PCT, color="gray", lw=0.8, ls=":")
                name = ", ".join(f"{k}={v}" for k, v in ((frow, rv), (fcol, cv)) if k)
                ax.set_title(name, fontsize=9)
                if x.endswith("gbps") or x in ("nodes", "seq", "microbatches"):
                    ax.set_xscale("log", base=2)
                ax.set_xticks(grid[x], [f"{v:g}" for v in grid[x]])
                ax.minorticks_off()
                ax.grid(alpha=0.3)
                if i == len(rvals) - 1:
                    ax.set_xlabel(x)
        handles, labels = axes[0][0].get_legend_handles_labels()
        if labels:
            fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)),
                       fontsize=8)
        fig.suptitle(title)
        fig.tight_layout(rect=(0, 0.04 + 0.03 * ((len(labels) + 3) // 4), 1, 0.97))
        out = path.with_name(path.stem + suffix + path.suffix)
        fig.savefig(out, dpi=90)
        outs.append(out)
    return outs
