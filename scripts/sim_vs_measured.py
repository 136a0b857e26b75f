"""Build docs/sim_vs_measured.md: `hsdp sim` next to measured `bench step` runs.

    python scripts/sim_vs_measured.py          # every run of docs/results/h200x2 (below)
    python scripts/sim_vs_measured.py runs/*/*_s*.json --calibrate-from self
    python scripts/sim_vs_measured.py runs/*/*_s*.json --calibrate-from runs/a/a.json

Measuring the rows: ``python -m hsdp bench suite --out results/`` on two H200s (the
bench's default model, 8 Llama-8B layers; 5 recorded and 3 profiled steps per schedule;
``hsdp.bench.suite`` lists the runs). Each run's JSON holds the host marks and per-op
stream times of the steps recorded without the profiler, and beside it lie the phases of
its profiled steps' Chrome traces (``hsdp.sim.calibrate.save_phases``), which is all the
calibration reads of a trace: the traces themselves stay under ``out/``.

Real NCCL (one rank per GPU): the fabric is the default one scaled to the run's measured
collective times (``comm_scale``), or ``--fabric-json`` from ``bench collectives``.

For each JSON and each hsdp schedule in it, the simulator runs the same setup (model,
mesh, microbatches, dtypes; the JSON's emulated fabric, else ``--fabric-json`` /
the defaults) and its step time, saving and busy times are set next to the measured
ones. Calibration (``hsdp.sim.calibrate``): ``self`` (default) fits each row to its own
run (when its Chrome traces, or their saved phases, are found next to the JSON, the
per-phase times: device time per phase class the least over the profiled steps, without
what the collective kernels beside it cost it (its drag, also measured there), host time
per phase and side op the median over the unprofiled recorded steps; else its compute
busy time); a path fits every row to that one run. JSONs of older runs hold one profiled
and one recorded step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "h200x2"  # the step runs of docs/benchmarks.md
sys.path.insert(0, str(ROOT / "src"))

from hsdp.sim.calibrate import (  # noqa: E402
    SCHEDULES,
    calibrate,
    fabric_of,
    setup_from_results,
)
from hsdp.sim.costs import CostModel  # noqa: E402
from hsdp.sim.engine import simulate  # noqa: E402
from hsdp.sim.fabric import Fabric, Link  # noqa: E402

PAIRS = (("overlap", "serial"), ("hfsdp", "hfsdp-serial"))
BUSY = (("compute", "compute"), ("inner_ag", "inner AG"), ("inner_rs", "inner RS"),
        ("outer", "outer"))
WITHIN_PCT = 5.0
# collectives that take no time (their own casts and copies still do): an emulated run's
# collective-free steps (``t_free_ms``)
INSTANT = Fabric(Link(1e15, 0.0), Link(1e15, 0.0))


def row_name(path: Path, meta: dict) -> str:
    m, mesh = meta["model"], meta["mesh"]
    bits = [f"{mesh['outer']}x{mesh['inner']}", f"seq {m['seq']}"]
    if m.get("microbatches", 1) > 1:
        bits.append(f"{m['microbatches']} microbatches")
    f = meta.get("fabric")
    if f and f["outer"]["bus_gbps"] != 47.0:
        bits.append(f"outer {f['outer']['bus_gbps']:g} GB/s")
    if not meta.get("emulate", True):
        bits.append("real NCCL")
    return f"{', '.join(bits)} (`{path.stem}`)"


def default_runs() -> list[Path]:
    """Each run folder's own JSON in ``RESULTS``, but the Megatron-FSDP runs (their hsdp
    schedule is the same run's second process, without saved phases)."""
    return sorted(d / f"{d.name}.json" for d in RESULTS.iterdir()
                  if (d / f"{d.name}.json").exists() and not d.name.endswith("_mfsdp"))


def compare(path: Path, calibration: str, base: CostModel) -> list[dict]:
    data = json.loads(path.read_text())
    meta = data["meta"]
    costs = dataclasses.replace(base, fabric=fabric_of(meta, base.fabric))
    rows = []
    for name, measured in data["schedules"].items():
        if name not in SCHEDULES or measured.get("t_step_ms") is None:
            continue
        source = path if calibration == "self" else Path(calibration)
        lead = "overlap" if SCHEDULES[name][0] == "hsdp" else "hfsdp"
        if calibration != "self" or lead not in data["schedules"]:
            lead = "overlap"
        own = name if calibration == "self" and name != lead else None
        cal = calibrate(source, costs, lead, times_from=own)
        setup = setup_from_results(data, name)
        r = simulate(setup, cal)
        cross = simulate(setup, calibrate(source, costs, lead)) if own else None
        alone = simulate(setup, dataclasses.replace(cal, peers=())) if cal.peers else None
        free = (simulate(setup, dataclasses.replace(cal, fabric=INSTANT))
                if measured.get("t_free_ms") else None)
        rows.append({"json": path.name, "row": row_name(path, meta), "schedule": name,
                     "run": {"date": meta.get("date"), "torch": meta.get("torch"),
                             "gpu": (meta.get("hardware") or {}).get("gpu"),
                             "emulate": meta.get("emulate")},
                     "sim_ms": r.t_step_ms, "measured": measured, "metrics": r.metrics,
                     "lead": lead, "sim_from_lead_ms": cross and cross.t_step_ms,
                     "sim_rank0_alone_ms": alone and alone.t_step_ms,
                     "sim_free_ms": free and free.t_step_ms,
                     "calibration": {"tflops": cal.tflops, "mem_gbps": cal.mem_gbps,
                                     "host_us_per_op": cal.host_us_per_op,
                                     "phases": len(cal.phases),
                                     "comm_scale": cal.comm_scale}})
        print(f"{path.name} {name}: sim {r.t_step_ms:.1f} ms, measured "
              f"{measured['t_step_ms']:.1f} ms", file=sys.stderr)
    return rows


def _pct(sim: float, measured: float) -> str:
    return f"{100.0 * (sim - measured) / measured:+.1f} %"


def render(rows: list[dict], command: str, calibration: str, host_us: float,
           note: str = "") -> str:
    errors = [100.0 * (r["sim_ms"] - r["measured"]["t_step_ms"]) / r["measured"]["t_step_ms"]
              for r in rows]
    within = sum(abs(e) <= WITHIN_PCT for e in errors)
    worst = max(range(len(rows)), key=lambda i: abs(errors[i])) if rows else None
    cal_text = (
        "each row is fitted to its run's overlapped schedule (hsdp's `overlap`, "
        "hfsdp's `hfsdp`), except for the host time per step and the collectives' busy "
        "times, which are the row's own schedule's: with the Chrome traces, the "
        "measured device time per phase (forward / backward / copy-in of each unit "
        "class; the least over the profiled steps, a run of older code has one, each "
        "without what the collective kernels beside it cost it) and the drag of each "
        "class (the share of its compute's speed lost beside a collective kernel: the "
        "slope of its instances' device time over their time beside one; the simulator "
        "slows compute by it wherever its collectives run), the "
        "memory bandwidth of the optimizer and copy-in, per collective kind the busy "
        "time (each op's median over the steps recorded without the profiler when the "
        "JSON has them) and the share of its own casts and copies that held compute up; "
        "the host time per phase and per side-stream op from the host marks of the "
        "steps recorded without the profiler when the JSON has them (the median over "
        "them; the profiler slows the host unevenly), else from the trace, scaled to "
        "the unprofiled host time `t_host_ms`; without a trace, only the achieved "
        "TFLOP/s, fitted to the run's compute busy time. A run that recorded every rank "
        "(real NCCL, `other_ranks`) gives each rank its own host times (device times are "
        "rank 0's), and each collective's busy time is the least over the ranks; the "
        "ranks are then simulated together, a collective starting when the last rank of "
        "its group is ready for it, so that the skew of their hosts makes the waits "
        "(column \"rank 0 alone\": every rank as rank 0)" if calibration == "self" else
        f"every row is fitted to one run, `{calibration}` (its trace's per-phase table "
        f"applies to rows of the same model, sequence and micro-batch size; the others "
        f"use the fitted TFLOP/s, memory bandwidth and host cost per op)")
    if host_us:
        cal_text += (f". A JSON with neither a trace nor `t_host_ms` gets a host cost of "
                     f"{host_us:g} us per compute op (`--host-us-per-op`)")
    out = [
        "# `hsdp sim` against measured step times",
        "",
        "<!-- generated by scripts/sim_vs_measured.py; do not edit by hand -->",
        "",
        "`hsdp sim` runs the runtime's own schedule (hooks, streams, events) on a "
        "meta-device model and times it on a virtual clock (README, Tools). This page "
        "sets its step time next to `bench step` measurements of the same setup: model, "
        "mesh, microbatches, dtypes and, for emulated runs, the fabric the run emulated.",
        "",
        f"Calibration: {cal_text}. {note}".rstrip(),
        "",
        "Measured: median [min-max] of the timed steps (wall clock between barriers, "
        "every stream idle at the end). Simulated: from the step's start to every stream "
        "idle.",
        "",
        "What is fitted and what is predicted: calibrated on a run, the simulator "
        "reproduces that run's compute busy time and, per collective kind, its busy time "
        "(`comm_scale`: measured over modelled, which absorbs e.g. collectives slowed by "
        "compute on the same GPU) by construction; with a trace, also each phase's host "
        "and device time. What it predicts is how the schedule composes them: the step "
        "time, the exposed communication and the outer tail, and for a serialized row the "
        "schedule itself. The column \"from the overlapped run\" also takes the host time "
        "and the collectives' busy times from the overlapped schedule (the what-if use); "
        "emulated collectives of the same modelled time ran a few % apart between the "
        "schedules of one run, host times up to 5 %. The column \"collective-free\" "
        "sets the same calibration with collectives that take no time next to an "
        "emulated run's steps without its delays (`t_free_ms`): it separates the model "
        "of compute and host from the one of communication.",
        "",
        "Regenerate:",
        "",
        "```",
        command,
        "```",
        "",
        "## Step time",
        "",
        f"{within} of {len(rows)} schedules within {WITHIN_PCT:g} %"
        + (f"; the largest error is {errors[worst]:+.1f} % ({rows[worst]['row']}, "
           f"{rows[worst]['schedule']})." if rows else "."),
        "",
        "| row | schedule | sim ms | measured ms | error | from the overlapped run: sim ms "
        "(error) | rank 0 alone: sim ms (error) | collective-free: sim / measured ms | "
        "sim host ms | measured host ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, e in zip(rows, errors):
        m = r["measured"]
        host = m.get("t_host_ms")
        flag = " **!**" if abs(e) > WITHIN_PCT else ""
        cells = [("-" if v is None else f"{v:.1f} ({_pct(v, m['t_step_ms'])})")
                 for v in (r["sim_from_lead_ms"], r["sim_rank0_alone_ms"])]
        free = r["sim_free_ms"]
        cells.append("-" if free is None else f"{free:.1f} / {m['t_free_ms']:.1f}")
        out.append(f"| {r['row']} | {r['schedule']} | {r['sim_ms']:.1f} | "
                   f"{m['t_step_ms']:.1f} [{m['t_step_min_ms']:.1f}-{m['t_step_max_ms']:.1f}] "
                   f"| {e:+.1f} %{flag} | {' | '.join(cells)} | "
                   f"{r['metrics']['host_busy_ms']:.1f} | "
                   f"{'-' if host is None else f'{host:.1f}'} |")
    no_host = sorted({r["row"] for r, e in zip(rows, errors) if abs(e) > WITHIN_PCT
                      and r["measured"].get("t_host_ms") is None
                      and not r["calibration"]["phases"] and not host_us})
    if no_host:
        out += ["", "Rows marked **!** whose JSON has neither the host time of the step "
                "(`t_host_ms`) nor a trace with phase marks: the simulator had no host cost "
                "to go on (the host is then never the bottleneck), so a host-bound step "
                "(short sequences) comes out short. Re-measure with the current `bench "
                "step` (it records both): " + "; ".join(no_host) + "."]
    out += ["", "## Saving of the overlap", "",
            "Serialized minus overlapped step time, ms (% of the serialized step).", "",
            "| row | pair | sim | measured |", "|---|---|---|---|"]
    by = {(r["json"], r["schedule"]): r for r in rows}
    for r in rows:
        for fast, slow in PAIRS:
            if r["schedule"] != fast or (r["json"], slow) not in by:
                continue
            s = by[(r["json"], slow)]
            sim = s["sim_ms"] - r["sim_ms"]
            meas = s["measured"]["t_step_ms"] - r["measured"]["t_step_ms"]
            out.append(f"| {r['row']} | {fast} vs {slow} | {sim:.2f} "
                       f"({100 * sim / s['sim_ms']:.1f} %) | {meas:.2f} "
                       f"({100 * meas / s['measured']['t_step_ms']:.1f} %) |")
    out += ["", "## Busy time per resource", "",
            "Overlapped schedules, sim / measured (ms; measured: the traced step).", "",
            "| row | schedule | " + " | ".join(label for _, label in BUSY)
            + " | exposed comm | outer tail |", "|---|---|" + "---|" * (len(BUSY) + 2)]
    for r in rows:
        if r["schedule"] not in ("overlap", "hfsdp"):
            continue
        sim, meas = r["metrics"], r["measured"].get("metrics") or {}
        mb = (meas.get("busy_ms") or {}).get("by_kind", {})

        def pair(a: float | None, b: float | None) -> str:
            return f"{a:.1f} / {'-' if b is None else f'{b:.1f}'}"

        cells = [pair(sim["busy_ms"]["by_kind"][k], mb.get(k)) for k, _ in BUSY]
        cells += [pair(sim["exposed_comm_ms"], meas.get("exposed_comm_ms")),
                  pair(sim["outer_tail_ms"], meas.get("outer_tail_ms"))]
        out.append(f"| {r['row']} | {r['schedule']} | " + " | ".join(cells) + " |")
    out += ["", "## Calibration per row", "",
            "`comm_scale`: measured over modelled busy time of inner all-gathers, inner "
            "reduce-scatters and outer collectives in the calibration run.", "",
            "| row | schedule | TFLOP/s | memory GB/s | host us/op | measured phases | "
            "comm_scale AG / RS / outer |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["calibration"]
        scale = " / ".join(f"{c['comm_scale'].get(k, 1.0):.2f}"
                           for k in ("inner_ag", "inner_rs", "outer"))
        out.append(f"| {r['row']} | {r['schedule']} | {c['tflops']:.0f} | "
                   f"{c['mem_gbps']:.0f} | {c['host_us_per_op']:.1f} | {c['phases']} | "
                   f"{scale} |")
    out += ["", "## Runs", "", "| JSON | date | GPU | torch | emulated |", "|---|---|---|---|---|"]
    for r in {r["json"]: r for r in rows}.values():
        run = r["run"]
        out.append(f"| `{r['json']}` | {run['date']} | {run['gpu']} | {run['torch']} | "
                   f"{run['emulate']} |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("jsons", nargs="*",
                   help=f"bench step JSONs (default: the runs of {RESULTS.relative_to(ROOT)})")
    p.add_argument("--calibrate-from", default="self", help="'self' or one bench step JSON")
    p.add_argument("--fabric-json", default=None,
                   help="`bench collectives` JSON for runs on real NCCL (no emulated fabric)")
    p.add_argument("--host-us-per-op", type=float, default=0.0,
                   help="host cost per compute op for JSONs with neither a trace nor "
                        "t_host_ms (default 0: the host is never the bottleneck)")
    p.add_argument("--out", default=str(ROOT / "docs" / "sim_vs_measured.md"))
    p.add_argument("--note", default="", help="where given numbers come from")
    args = p.parse_args()
    paths = [Path(j) for j in args.jsons] or default_runs()
    base = CostModel(host_us_per_op=args.host_us_per_op)
    if args.fabric_json:
        from hsdp.bench.step import fabric_from_collectives  # the script, not sim

        base = dataclasses.replace(base, fabric=fabric_from_collectives(args.fabric_json,
                                                                        20.0))
    rows = [r for path in paths for r in compare(path, args.calibrate_from, base)]
    command = "python scripts/sim_vs_measured.py " + shlex.join(sys.argv[1:])
    Path(args.out).write_text(render(rows, command.strip(), args.calibrate_from,
                                     args.host_us_per_op, args.note))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
