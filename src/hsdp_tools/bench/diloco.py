"""bench diloco: step time and outer bytes of DiLoCo against synchronous hsdp / hfsdp.

One process poses as rank 0 of an OUTERxINNER mesh (torch's fake process group, every
collective delayed by its modelled time on ``hsdp_tools.sim.fabric``, as ``bench step
--emulate``), for each ``--outer-gbps``: synchronous hsdp and hfsdp, with and without the
int8 outer reduction, DiLoCo (``init_mesh(outer_sync=...)``) at several H, F and delays,
and the same model with no communication at all (the delays off). Each row trains one
model (trainee of ``hsdp_tools.bench.trainee``; AdamW) for ``--warmup`` steps, then times
``--repeats`` blocks of steps back to back (synchronous rows: ``--steps`` steps; DiLoCo:
a whole period of H steps), the streams drained only at the end of each, as training runs
them: the step time is a block's mean, the fastest block's (other load on the machine
only ever slows a block down); outer bytes per step are what this rank's outer
collectives moved in them (0 for the rows without outer communication: they stand for a
model that has none, though the emulation still issues its collectives over free links).
The measurement runs on CPU by default: a CPU's step, with the links scaled by
``--link-scale``, checks the schedules and the simulator against each other; it is not a
GPU's step time (``--sim-only --profile`` predicts a GPU's; ``--device cuda`` measures
one).

Beside each row, ``hsdp sim``'s prediction of the same setup (``hsdp_tools.sim.engine``: the
runtime on the virtual clock; a DiLoCo period timed by ``period_steps``): its compute
costs are scaled so that the simulated no-communication step equals the measured one
(``--sim-only``: not measured; priced by ``--profile``, e.g. a GPU's, or the defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

import hsdp
from hsdp.runtime.outer_modes import parse_mode
from hsdp_tools.bench.emulate import fake_mesh
from hsdp_tools.bench.trainee import Trainee, build, synthetic_batches
from hsdp_tools.models import LlamaConfig, ModelConfig, lm_loss, preset
from hsdp_tools.report.table import print_table
from hsdp_tools.sim.costs import CostModel
from hsdp_tools.sim.engine import Setup, simulate
from hsdp_tools.sim.fabric import Fabric, Link
from hsdp_tools.sim.profile import MachineProfile

OFF = "no communication"
# row -> (bench schedule, outer_sync, links taking time: "both", "inner" or "none");
# "-q" schedules: the int8 outer reduction
ROWS: dict[str, tuple[str, str, str]] = {
    OFF: ("overlap", "none", "none"),
    "no outer communication": ("overlap", "none", "inner"),
    "hsdp": ("overlap", "none", "both"),
    "hsdp int8": ("overlap-q", "none", "both"),
    "hfsdp": ("hfsdp", "none", "both"),
    "hfsdp int8": ("hfsdp-q", "none", "both"),
    "DiLoCo H10 F1": ("overlap", "diloco:inner_steps=10", "both"),
    "DiLoCo H50 F1": ("overlap", "diloco:inner_steps=50", "both"),
    "DiLoCo H10 F4": ("overlap", "diloco:inner_steps=10,fragments=4", "both"),
    "DiLoCo H50 F4": ("overlap", "diloco:inner_steps=50,fragments=4", "both"),
    "DiLoCo H50 F4 delay 5": ("overlap", "diloco:inner_steps=50,fragments=4,delay=5", "both"),
    "DiLoCo H50 F4 delay 5 int8": ("overlap-q", "diloco:inner_steps=50,fragments=4,delay=5",
                                   "both"),
}
# CPU: 5 blocks (with the embedding, head and root 8 units, which 4 fragments divide), few
# tokens: the step is short; --link-scale slows the links to a GPU's ratio of
# communication to compute
CPU_MODEL = LlamaConfig(vocab=4096, hidden=512, heads=8, kv_heads=4, ffn=1408, layers=5,
                        seq=8)
FREE = Link(1e12, 0.0)  # a link taking no time
CPU_CAVEAT = ("CPU: measured on this machine's CPU (one process posing as rank 0, links x"
              "{scale:g}); the step times check the schedules and the simulator against "
              "each other, they are not a GPU's (--sim-only --profile predicts a GPU's)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default="16x8", help="OUTERxINNER (default 16x8)")
    p.add_argument("--outer-gbps", default="1,3", help="outer bus GB/s, comma-separated")
    p.add_argument("--inner-gbps", type=float, default=370.0)
    p.add_argument("--latency-us", type=float, default=20.0)
    p.add_argument("--link-scale", type=float, default=1.0,
                   help="emulate links K times the given bandwidth and 1/K the latency "
                        "(K < 1: a slow CPU step against a GPU's communication ratio; the "
                        "table keeps the given GB/s)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated among: {', '.join(ROWS)} (default: all)")
    p.add_argument("--steps", type=int, default=5, help="timed steps of a synchronous row")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed blocks per row (whole "
                   "DiLoCo periods); the fastest counts: a shared CPU only ever slows one")
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--sim-only", action="store_true", help="predict, do not measure")
    p.add_argument("--model", default=None, help="an hsdp_tools.models preset (default: the CPU "
                   "model above); e.g. llama-8b with --layers 9 --seq 4096 --sim-only")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16 (parameters)")
    p.add_argument("--profile", default=None, help="`hsdp sim calibrate` machine profile "
                   "pricing --sim-only")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the rows are measured (cuda: GPU 0, links emulated by sleeps "
                        "on the GPU, as bench step --emulate)")
    p.add_argument("--json", default=None)


def _model(args: argparse.Namespace) -> ModelConfig:
    sizes = {k: v for k in ("layers", "seq") if (v := getattr(args, k)) is not None}
    if args.model is None:
        return dataclasses.replace(CPU_MODEL, **sizes)
    return preset(args.model, **sizes)


def _setup(model: ModelConfig, outer: int, inner: int, row: str, mbs: int,
           dtype: str) -> Setup:
    schedule, outer_sync, _ = ROWS[row]
    return Setup(model, outer, inner, "hfsdp" if schedule.startswith("hfsdp") else "hsdp",
                 True, 1, mbs, dtype, "fp32",
                 outer_reduce="int8" if schedule.endswith("-q") else "none",
                 outer_sync=outer_sync)


def measure(model: ModelConfig, outer: int, inner: int, row: str, fabric: Fabric,
            args: argparse.Namespace) -> dict:
    """One row, emulated: mean step time (ms) over whole periods, outer bytes per step."""
    schedule, outer_sync, links = ROWS[row]
    sync = parse_mode("outer_sync", outer_sync)
    device = torch.device(args.device)
    mesh = hsdp.init_mesh(outer, inner, device.type, outer_sync=sync)
    mp = hsdp.MixedPrecision(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[
        args.dtype]), torch.float32)
    t = build(schedule, model, mp, mesh, device, fabric, True,
              outer_reduce=hsdp.OuterReduce("int8") if schedule.endswith("-q") else None)
    batches = synthetic_batches(model.vocab, args.mbs, model.seq, 1, device)
    delays = links != "none"
    for _ in range(args.warmup):
        t.step(batches, delays)
    steps = args.steps if sync is None else sync.inner_steps
    outer_before = _outer_bytes(t.collective_bytes)
    samples = [_timed_steps(t, batches, steps, delays) for _ in range(args.repeats)]
    nbytes = _outer_bytes(t.collective_bytes) - outer_before
    return {"t_step_ms": min(samples), "samples_ms": samples, "steps": steps,
            "outer_bytes_per_step": counted_outer_bytes(row, nbytes / (steps * args.repeats))}


def _timed_steps(t: Trainee, batches: list[torch.Tensor], steps: int, delays: bool) -> float:
    """Mean step time (ms) of ``steps`` steps back to back, drained at the end."""
    with t.comm(delays):
        t0 = time.perf_counter()
        for _ in range(steps):
            for tokens in batches:
                with t.microbatch(True):
                    lm_loss(t.model(tokens), tokens).backward()
            t.update()
        t.drain()
        return (time.perf_counter() - t0) * 1e3 / steps


def _outer_bytes(nbytes: dict[str, int]) -> int:
    return sum(v for k, v in nbytes.items() if k.endswith(":outer"))


def counted_outer_bytes(row: str, nbytes: float) -> float:
    """``nbytes`` where ``row`` has outer communication; 0 where it stands for a model
    without (its collectives run over free links)."""
    return nbytes if ROWS[row][2] == "both" else 0.0


def row_fabric(row: str, inner: Link, outer: Link) -> Fabric:
    """The links of ``row``: those it does not count take no time."""
    links = ROWS[row][2]
    return Fabric(FREE if links == "none" else inner, outer if links == "both" else FREE)


def predict(row: str, setup: Setup, fabric: Fabric, costs: CostModel) -> dict:
    r = simulate(setup, dataclasses.replace(costs, fabric=fabric))
    return {"t_step_ms": r.t_step_ms,
            "outer_bytes_per_step": counted_outer_bytes(row, r.metrics["outer_bytes_per_step"])}


def run(args: argparse.Namespace) -> int:
    outer, inner = (int(x) for x in args.mesh.split("x"))
    model, rows = _model(args), args.rows.split(",")
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise SystemExit(f"hsdp bench diloco: unknown rows {bad}; known: {', '.join(ROWS)}")
    base = CostModel()
    if args.profile:
        base = MachineProfile.load(args.profile).cost_model(base.fabric)
    results: dict[str, dict] = {}
    if not args.sim_only:
        if args.device == "cuda":
            torch.cuda.set_device(0)
        fake_mesh(outer, inner, args.device)
    k = args.link_scale
    inner_link = Link(args.inner_gbps * k, args.latency_us / k)
    for gbps in (float(g) for g in args.outer_gbps.split(",")):
        outer_link = Link(gbps * k, args.latency_us / k)
        costs, out = base, {}
        for row in rows:
            setup = _setup(model, outer, inner, row, args.mbs, args.dtype)
            fabric = row_fabric(row, inner_link, outer_link)
            if not args.sim_only:
                out[row] = measure(model, outer, inner, row, fabric, args)
                print(f"{gbps:g} GB/s {row}: {out[row]}", flush=True)
            if row == OFF and not args.sim_only:  # scale the compute to the measured step
                sim_off = predict(row, setup, fabric, base)["t_step_ms"]
                scale = sim_off / out[row]["t_step_ms"]
                costs = dataclasses.replace(base, tflops=base.tflops * scale,
                                            mem_gbps=base.mem_gbps * scale)
            sim = predict(row, setup, fabric, costs)
            out.setdefault(row, {})["sim_t_step_ms"] = sim["t_step_ms"]
            out[row]["sim_outer_bytes_per_step"] = sim["outer_bytes_per_step"]
        results[f"{gbps:g}"] = out
    report = {"meta": {"mesh": args.mesh, "model": dataclasses.asdict(model),
                       "num_params": model.num_params, "mbs": args.mbs, "dtype": args.dtype,
                       "inner_gbps": args.inner_gbps, "latency_us": args.latency_us,
                       "link_scale": args.link_scale, "device": args.device,
                       "sim_only": args.sim_only, "profile": args.profile},
              "outer_gbps": results}
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _print(report: dict) -> None:
    bases = (OFF, "no outer communication")
    lines = []
    for gbps, out in report["outer_gbps"].items():
        for row, r in out.items():
            cells = [gbps, row]
            for key in ("t_step_ms", "sim_t_step_ms"):
                cells.append("-" if key not in r else f"{r[key]:.1f}")
                cells += [f"{r[key] / out[b][key]:.3f}" if key in r and key in out.get(b, {})
                          else "-" for b in bases]
            nbytes = r.get("outer_bytes_per_step", r["sim_outer_bytes_per_step"])
            lines.append([*cells, f"{nbytes / 1e6:.2f}"])
    measured_on_cpu = not report["meta"]["sim_only"] and report["meta"]["device"] == "cpu"
    notes = [CPU_CAVEAT.format(scale=report["meta"]["link_scale"])] if measured_on_cpu else []
    print_table(f"bench diloco, mesh {report['meta']['mesh']}",
                ["outer GB/s", "row", "step ms", "x none", "x no outer", "sim ms",
                 "sim x none", "sim x no outer", "outer MB / step / rank"], lines,
                [*notes, "outer MB: 0 for the rows without outer communication"])
