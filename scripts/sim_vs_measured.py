"""Build docs/sim_vs_measured.md: `hsdp sim` predictions next to measured `bench step` runs
that the machine profile was not calibrated on (held out).

    python scripts/sim_vs_measured.py                  # the committed machines (below)
    python scripts/sim_vs_measured.py --machine docs/results/h200/profile.json runs/*/*.json
    python scripts/sim_vs_measured.py --predict docs/results/h200/predictions/x.json

Each machine kind has one profile (``python -m hsdp sim calibrate``: one `bench step` run,
and `bench collectives` of the same machine for its links), and every other step run of
that machine kind is predicted from it and the run's setup alone (model, mesh, sequence,
microbatches, dtypes; an emulated run's fabric, else the profile's measured links). A row
whose JSON is one the profile was made from is refused (``hsdp_tools.sim.profile.held_out``).

Machine kinds of the committed runs (docs/results): ``h200``, one H200: the emulated runs
(one process on one GPU, collectives emulated on the run's fabric); ``h200x2``, two
H200s of one host: the real-NCCL runs (one rank per GPU).

``--predict`` writes the profile's predictions for runs not yet made (``PREDICTED``,
with the exact `bench step` commands), to be set next to the runs once measured: the
page shows them when their JSONs are under docs/results/<machine>/<run>/.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
sys.path.insert(0, str(ROOT / "src"))

from hsdp_tools.sim.calibrate import (  # noqa: E402
    SCHEDULES,
    fabric_of,
    measured_busy_ms,
    setup_from_results,
)
from hsdp_tools.sim.engine import simulate  # noqa: E402
from hsdp_tools.sim.fabric import Fabric  # noqa: E402
from hsdp_tools.sim.profile import MachineProfile, held_out, same_run  # noqa: E402

WITHIN_PCT = 5.0
KINDS = ("compute", "inner_ag", "inner_rs", "outer")
MACHINES = {"h200": "one H200 (emulated meshes: one process on one GPU; the runs under "
                    "h200x2/ on a two-GPU host, those under h200/ on a one-GPU machine)",
            "h200x2": "two H200s of one host (real NCCL, one rank per GPU)"}
# Runs not yet made, predicted in advance: name -> `bench step` arguments (the suite's
# STEP_ARGS and the emulated 16x8 rows' defaults: 8 Llama-8B layers, fabric 370 / 47 GB/s).
BENCH = ("bench", "step", "--reduce-dtype", "bf16", "--record-steps", "5", "--trace-steps",
         "3", "--warmup", "2", "--emulate", "--steps", "5")
PREDICTED = {
    "emu16x8_s2048": ("--mesh", "16x8", "--seq", "2048", "--schedules", "overlap,serial"),
    "emu16x8_s8192_mb2": ("--mesh", "16x8", "--seq", "8192", "--microbatches", "2",
                          "--schedules", "overlap,serial"),
    "emu16x8_s2048_mb2": ("--mesh", "16x8", "--seq", "2048", "--microbatches", "2",
                          "--schedules", "overlap,serial"),
    "emu2x4_s2048_outer12.5": ("--mesh", "2x4", "--seq", "2048", "--outer-gbps", "12.5",
                               "--schedules", "overlap,serial,hfsdp,hfsdp-serial"),
}


def step_runs() -> dict[str, list[Path]]:
    """The committed `bench step` runs per machine kind (module doc), but the
    Megatron-FSDP ones (their hsdp schedule is that run's second process)."""
    out: dict[str, list[Path]] = {k: [] for k in MACHINES}
    for folder in sorted(p for d in ("h200", "h200x2") for p in (RESULTS / d).iterdir()
                         if p.is_dir()):
        path = folder / f"{folder.name}.json"
        if not path.exists() or folder.name.endswith("_mfsdp"):
            continue
        emulated = json.loads(path.read_text())["meta"].get("emulate", True)
        out["h200" if emulated else "h200x2"].append(path)
    return out


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


def predict(profile: MachineProfile, meta: dict, schedule: str, data: dict) -> dict:
    """The profile's prediction of one schedule of a run described by ``data``."""
    costs = profile.cost_model(fabric_of(meta, profile.fabric(Fabric())))
    r = simulate(setup_from_results(data, schedule), costs)
    return {"t_step_ms": r.t_step_ms, "host_ms": r.metrics["host_busy_ms"],
            "busy_ms": {k: r.metrics["busy_ms"]["by_kind"][k] for k in KINDS},
            "exposed_comm_ms": r.metrics["exposed_comm_ms"],
            "outer_tail_ms": r.metrics["outer_tail_ms"]}


def compare(profile: MachineProfile, path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    meta = data["meta"]
    rows = []
    for name, m in data["schedules"].items():
        if name not in SCHEDULES or m.get("t_step_ms") is None:
            continue
        sim = predict(profile, meta, name, data)
        busy = dict((m.get("metrics") or {}).get("busy_ms", {}).get("by_kind", {}))
        busy |= measured_busy_ms(path, data, name, emulated=meta.get("emulate", True))
        rows.append({"json": path.name, "row": row_name(path, meta), "schedule": name,
                     "sim": sim, "measured": {"t_step_ms": m["t_step_ms"],
                                              "min": m["t_step_min_ms"],
                                              "max": m["t_step_max_ms"],
                                              "host_ms": m.get("t_host_ms"), "busy_ms": busy}})
        print(f"{path.name} {name}: sim {sim['t_step_ms']:.1f} ms, measured "
              f"{m['t_step_ms']:.1f} ms", file=sys.stderr)
    return rows


def _err(sim: float, measured: float) -> float:
    return 100.0 * (sim - measured) / measured


def worst_terms(r: dict) -> str:
    """The row's terms, sim minus measured (ms), largest first."""
    s, m = r["sim"], r["measured"]
    terms = {"host": s["host_ms"] - (m["host_ms"] or s["host_ms"])}
    terms |= {f"{k} busy": s["busy_ms"][k] - m["busy_ms"].get(k, 0.0) for k in KINDS}
    order = sorted(terms, key=lambda k: -abs(terms[k]))
    return ", ".join(f"{k} {terms[k]:+.1f} ms" for k in order)


def render_machine(kind: str, profile_path: Path, rows: list[dict]) -> list[str]:
    profile = MachineProfile.load(profile_path)
    errors = [_err(r["sim"]["t_step_ms"], r["measured"]["t_step_ms"]) for r in rows]
    within = sum(abs(e) <= WITHIN_PCT for e in errors)
    worst = max(range(len(rows)), key=lambda i: abs(errors[i]))
    rel = profile_path.relative_to(ROOT) if profile_path.is_relative_to(ROOT) else profile_path
    out = [f"## {kind}: {MACHINES.get(kind, kind)}", "",
           f"Profile `{rel}`, calibrated on "
           + ", ".join(f"`{s}`" for s in profile.sources["step"] + profile.sources["collectives"])
           + f" ({profile.tflops:.0f} TFLOP/s over the measured phases, "
           + ", ".join(f"{c} {v:.0f}" for c, v in sorted(profile.class_tflops.items()))
           + f"; {profile.mem_gbps:.0f} GB/s; links: "
           + (", ".join(f"{a} {v['bus_gbps']:.0f} GB/s + {v['latency_us']:.0f} us"
                        for a, v in profile.links.items()) or "the run's emulated fabric")
           + "). Predicted: every other run of this machine kind.", "",
           f"**{within} of {len(rows)} held-out schedules within {WITHIN_PCT:g} %**; the worst "
           f"is {errors[worst]:+.1f} % ({rows[worst]['row']}, {rows[worst]['schedule']}); its "
           f"terms, predicted minus measured: {worst_terms(rows[worst])}.", "",
           "| row | schedule | sim ms | measured ms | error | host sim / measured ms | "
           + " | ".join(f"{k} busy sim / measured ms" for k in KINDS) + " |",
           "|---|---|---|---|---|---|" + "---|" * len(KINDS)]
    for r, e in zip(rows, errors):
        s, m = r["sim"], r["measured"]
        flag = " **!**" if abs(e) > WITHIN_PCT else ""
        host = "-" if m["host_ms"] is None else f"{m['host_ms']:.1f}"
        busy = " | ".join(f"{s['busy_ms'][k]:.1f} / {m['busy_ms'].get(k, 0.0):.1f}"
                          for k in KINDS)
        out.append(f"| {r['row']} | {r['schedule']} | {s['t_step_ms']:.1f} | "
                   f"{m['t_step_ms']:.1f} [{m['min']:.1f}-{m['max']:.1f}] | {e:+.1f} %{flag} | "
                   f"{s['host_ms']:.1f} / {host} | {busy} |")
    return out + [""]


def render_predicted(predictions: list[Path]) -> list[str]:
    out = ["## Predicted before the run", "",
           "Committed before the run was made (`--predict`): the file, its commit, and the "
           "measured run once it is under docs/results/<machine>/<run>/.", "",
           "| run | schedule | predicted ms | measured ms | error | predicted busy "
           "compute / AG / RS / outer ms | measured |", "|---|---|---|---|---|---|---|"]
    for path in predictions:
        pred = json.loads(path.read_text())
        for name, run in pred["runs"].items():
            measured = RESULTS / pred["machine"] / name / f"{name}.json"
            data = json.loads(measured.read_text()) if measured.exists() else None
            for sched, p in run["schedules"].items():
                m = (data or {}).get("schedules", {}).get(sched)
                cells = ["not yet measured", "-", "-"]
                if m and m.get("t_step_ms") is not None:
                    mb = (m.get("metrics") or {}).get("busy_ms", {}).get("by_kind", {})
                    mb |= measured_busy_ms(measured, data, sched,
                                           emulated=data["meta"].get("emulate", True))
                    cells = [f"{m['t_step_ms']:.1f}",
                             f"{_err(p['t_step_ms'], m['t_step_ms']):+.1f} %",
                             " / ".join(f"{mb.get(k, 0.0):.1f}" for k in KINDS)]
                out.append(f"| `{name}` | {sched} | {p['t_step_ms']:.1f} | {cells[0]} | "
                           f"{cells[1]} | "
                           + " / ".join(f"{p['busy_ms'][k]:.1f}" for k in KINDS)
                           + f" | {cells[2]} |")
    return out + [""]


def write_predictions(out: Path, profile_path: Path, machine: str) -> None:
    """``PREDICTED``'s runs as the profile predicts them, with their commands."""
    profile = MachineProfile.load(profile_path)
    template = json.loads(Path(profile.sources["step"][0]).read_text())
    runs = {}
    for name, argv in PREDICTED.items():
        args = dict(zip(argv[::2], argv[1::2]))
        outer, inner = (int(v) for v in args["--mesh"].split("x"))
        model = template["meta"]["model"] | {
            "seq": int(args["--seq"]), "microbatches": int(args.get("--microbatches", 1))}
        fabric = template["meta"]["fabric"] | {"outer": template["meta"]["fabric"]["outer"] | {
            "bus_gbps": float(args.get("--outer-gbps", 47.0))}}
        meta = template["meta"] | {"mesh": {"outer": outer, "inner": inner},
                                   "model": model, "fabric": fabric}
        data = {"meta": meta}
        json_path = f"results/{machine}/{name}/{name}.json"
        runs[name] = {
            "command": shlex.join(["python", "-m", "hsdp", *BENCH, *argv, "--json", json_path,
                                   "--out-dir", f"out/{name}"]),
            "schedules": {s: predict(profile, meta, s, data)
                          for s in args["--schedules"].split(",")}}
        print(f"predicted {name}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "profile": str(profile_path),
                               "profile_sources": profile.sources, "runs": runs},
                              indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--machine", nargs="+", action="append", metavar=("PROFILE", "JSON"),
                   help="a machine profile and the `bench step` JSONs it predicts (again "
                        "per machine); default: the committed ones (module doc)")
    p.add_argument("--predictions", nargs="*", default=None,
                   help="prediction JSONs to show (default: docs/results/*/predictions/)")
    p.add_argument("--predict", metavar="OUT", default=None,
                   help="write the predictions of PREDICTED's runs here, then stop")
    p.add_argument("--profile", default=str(RESULTS / "h200" / "profile.json"),
                   help="the profile --predict uses (default: docs/results/h200's)")
    p.add_argument("--out", default=str(ROOT / "docs" / "sim_vs_measured.md"))
    p.add_argument("--note", default="", help="text after the tables")
    args = p.parse_args()
    for key in ("predict", "profile", "out"):  # paths as given; the profiles' from the root
        if getattr(args, key):
            setattr(args, key, str(Path(getattr(args, key)).resolve()))
    args.machine = [[str(Path(x).resolve()) for x in m] for m in args.machine or []]
    args.predictions = (None if args.predictions is None
                        else [str(Path(x).resolve()) for x in args.predictions])
    os.chdir(ROOT)
    if args.predict:
        write_predictions(Path(args.predict), Path(args.profile),
                          Path(args.profile).parent.name)
        print(f"wrote {args.predict}")
        return 0
    if args.machine:
        profiles = [(Path(m[0]), MachineProfile.load(m[0]), [Path(j) for j in m[1:]])
                    for m in args.machine]
    else:  # each committed profile and every other run of its machine kind
        runs = step_runs()
        profiles = [(RESULTS / k / "profile.json", MachineProfile.load(
            RESULTS / k / "profile.json"), []) for k in MACHINES]
        for path, profile, jsons in profiles:
            made_from = profile.sources["step"] + profile.sources["collectives"]
            jsons += [j for j in runs[path.parent.name]
                      if not any(same_run(j, s) for s in made_from)]
    for path, profile, jsons in profiles:  # before any simulation
        try:
            held_out(profile, jsons)
        except ValueError as e:
            raise SystemExit(f"sim_vs_measured: {path}: {e}") from None
    lines = [
        "# `hsdp sim` against measured step times, held out",
        "",
        "<!-- generated by scripts/sim_vs_measured.py; do not edit by hand -->",
        "",
        "`hsdp sim` runs the runtime's own schedule (hooks, streams, events) on a "
        "meta-device model and times it on a virtual clock (README, Tools). Each machine "
        "kind has one profile (`python -m hsdp sim calibrate`: one `bench step` run and "
        "`bench collectives` of the same machine; `hsdp_tools.sim.profile`), and every other "
        "run of that machine kind is predicted from the profile and the run's setup "
        "alone: model, mesh, sequence, microbatches, dtypes, and an emulated run's fabric "
        "(else the profile's measured links). No row below was calibrated on: the script "
        "refuses a row whose run made the profile.",
        "",
        "Measured: median [min-max] of the timed steps (wall clock between barriers, every "
        "stream idle at the end); host: the time to issue the step (`t_host_ms`); busy: "
        "compute from the traced step, collectives per kind from the steps recorded "
        "without the profiler (each op's median; on real NCCL the least over the ranks). "
        "Simulated: from the step's start to every stream idle.",
        "",
        "Regenerate: `python scripts/sim_vs_measured.py "
        + " ".join("NOTE" if a == args.note else shlex.quote(a) for a in sys.argv[1:])
        + "`" + (" (NOTE: the last section's text)" if args.note else ""),
        "",
    ]
    for path, profile, jsons in profiles:
        rows = [r for j in jsons for r in compare(profile, j)]
        kind = path.parent.name
        lines += render_machine(kind, path, rows)
    predictions = ([Path(x) for x in args.predictions] if args.predictions is not None
                   else sorted(RESULTS.glob("*/predictions/*.json")))
    if predictions:
        lines += render_predicted(predictions)
    if args.note:
        lines += [args.note, ""]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
