"""Simulate one training step (overlapped vs serialized) or sweep what-if grids, no GPU.

The runtime's own schedule runs on a meta-device model over virtual streams (see
``hsdp_tools.sim.engine``); every op is priced by the cost model (``hsdp_tools.sim.costs``): the
model's FLOPs at an achieved TFLOP/s, the optimizer and the gradient copy-in at a memory
bandwidth, collectives on the fabric, host time per op. ``--calibrate-from`` fits the
compute (and, from its traces, per-phase host and device times) to a ``bench step`` JSON;
``hsdp sim calibrate`` turns one such run (and ``bench collectives`` of the same machine)
into a machine profile (``hsdp_tools.sim.profile``) that ``--profile`` prices any setup with.
``--sweep`` runs a grid and says, per row, whether the overlap pays.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from hsdp.sharding.policy import Strategy
from hsdp.topology.communicators import COMMUNICATORS
from hsdp_tools.models import PRESETS, LlamaConfig, preset
from hsdp_tools.models_moe import MoEConfig
from hsdp_tools.report.args import DTYPES, parse_mesh
from hsdp_tools.report.table import print_table
from hsdp_tools.sim.calibrate import calibrate
from hsdp_tools.sim.costs import CostModel
from hsdp_tools.sim.engine import Setup, SimResult, simulate
from hsdp_tools.sim.fabric import Fabric, Link
from hsdp_tools.sim.profile import MachineProfile, calibrate_profile
from hsdp_tools.sim.quant_pricing import x_floor_from_bench
from hsdp_tools.sim.sweep import parse_sweep, print_sweep, run_sweep

# (overlapped, serialized) schedule names per strategy, as in ``bench step``
SCHEDULE_NAMES = {"hsdp": ("overlap", "serial"), "hfsdp": ("hfsdp", "hfsdp-serial")}
METRIC_KEYS = ("t_step_ms", "host_busy_ms", "exposed_comm_ms", "outer_tail_ms",
               "comm_comm_overlap_ms", "lower_bound_ms")
MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument("--model", choices=list(PRESETS), default="llama-8b",
                       help="named sizes (default llama-8b); the options below override them")
    for name in MODEL_FIELDS:
        model.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    model.add_argument("--mbs", type=int, default=1, help="sequences per rank per microbatch")
    model.add_argument("--experts", type=int, default=0,
                       help="a mixture of experts (hsdp_tools.models_moe; llama models): experts "
                            "per block, each of width --ffn (default 0: dense)")
    model.add_argument("--top-k", type=int, default=2, help="experts per token (--experts)")
    model.add_argument("--ep", type=int, default=1,
                       help="expert-parallel ranks, a divisor of inner (--experts): the "
                            "experts' units on hsdp.expert_mesh, the token all-to-all priced "
                            "on the inner link (hsdp_tools.sim.ep_pricing)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="microbatches per step (outer reduction on the last only)")
    p.add_argument("--mesh", type=parse_mesh, default=(16, 8), help="OUTERxINNER (16x8)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per data-parallel rank (llama; "
                        "hsdp_tools.sim.tp_pricing): "
                        "its collectives priced on compute; with tp filling a node the inner "
                        "group crosses nodes (set --inner-gbps to match)")
    p.add_argument("--strategy", choices=[s.value for s in Strategy], default="hsdp")
    p.add_argument("--outer-reduce", default="none", metavar="DTYPE[:BLOCK]",
                   help="compressed outer reduction: none, int8 or fp8_e4m3 (sweep key "
                        "outer_reduce=none,int8 compares them)")
    p.add_argument("--outer-gather", default="none", metavar="DTYPE[:BLOCK]",
                   help="hfsdp's compressed outer parameter all-gather: none, int8 or "
                        "fp8_e4m3 (sweep key outer_gather=none,int8 compares them)")
    p.add_argument("--outer-sync", default="none", metavar="diloco:FIELD=VALUE,...",
                   help="DiLoCo on the outer axis (init_mesh's outer_sync), e.g. "
                        "diloco:inner_steps=50,fragments=4: t_step is the mean over a period "
                        "(delay 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype")
    p.add_argument("--float8", action="store_true",
                   help="torchao float8 linears (tensorwise, float8 all-gather on: 1 byte "
                        "per weight element); needs hsdp[float8]")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32",
                   help="gradient reduction dtype")
    cost = p.add_argument_group("cost model")
    cost.add_argument("--tflops", type=float, default=600.0,
                      help="achieved TFLOP/s on the model's FLOPs (default 600)")
    cost.add_argument("--float8-speedup", type=float, default=2.0,
                      help="with --float8: float8 matmuls' speed over --tflops (2.0: the "
                           "H100/H200 dense FP8 / BF16 peak ratio; a measured ratio beats it)")
    cost.add_argument("--mem-gbps", type=float, default=3000.0,
                      help="memory GB/s of the optimizer and gradient copy-in (default 3000)")
    cost.add_argument("--host-us-per-op", type=float, default=0.0,
                      help="host time to issue one compute op, us (default 0)")
    cost.add_argument("--host-us-per-side-op", type=float, default=0.0,
                      help="host time to issue one collective / stream op, us (default 0)")
    cost.add_argument("--exclusive", type=float, default=1.0, metavar="SHARE",
                      help="share of a collective's own casts and copies that holds up "
                           "compute (default 1: large casts fill the GPU; measured 0.7-1 "
                           "with inner 1-2 at seq 4096, 0.1-0.4 with inner 8)")
    cost.add_argument("--calibrate-from", metavar="JSON", default=None,
                      help="fit the compute and host costs to a `bench step` JSON (and the "
                           "Chrome traces it names, if found): overrides the five above")
    cost.add_argument("--profile", metavar="JSON", default=None,
                      help="price with a machine profile (`hsdp sim calibrate`): overrides "
                           "the cost options above; its measured links replace the flags'")
    cost.add_argument("--inner-gbps", type=float, default=370.0, help="inner bus GB/s")
    cost.add_argument("--outer-gbps", type=float, default=47.0, help="outer bus GB/s")
    cost.add_argument("--latency-us", type=float, default=20.0, help="per collective, us")
    cost.add_argument("--tp-gbps", type=float, default=370.0, help="tp bus GB/s (--tp)")
    p.add_argument("--sweep", nargs="+", metavar="KEY=V1,V2", default=None,
                   help="what-if grid over nodes (outer), inner, seq, mbs, microbatches, "
                        "outer_gbps, inner_gbps, reduce, strategy, outer_reduce, "
                        "outer_gather; e.g. nodes=2,8 seq=1024,4096")
    p.add_argument("--json", default=None, metavar="PATH", help="write results here")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="write the timeline (single run) or the sweep plots (PATH, "
                        "PATH_ms, PATH_bound) here")
    sub = p.add_subparsers(dest="sim_command", metavar="COMMAND")
    cal = sub.add_parser("calibrate", allow_abbrev=False,
                         help="write a machine profile from one `bench step` run",
                         description="A machine profile (hsdp_tools.sim.profile) from one `bench "
                                     "step` JSON and `bench collectives` JSONs of the same "
                                     "machine.")
    cal.add_argument("step", help="`bench step` JSON (its traces' phases beside it)")
    cal.add_argument("--collectives", nargs="*", default=[], metavar="JSON",
                     help="`bench collectives` JSONs of the same machine: its links")
    cal.add_argument("--machine", default="", help="a name for the machine (e.g. h200)")
    cal.add_argument("--quant", default=None, metavar="JSON",
                     help="`bench quant` JSON of the same kind of card: the fused "
                          "quantization passes' time over the copy floor")
    cal.add_argument("--out", required=True, help="where the profile goes")
    cal.set_defaults(run=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    try:
        profile = calibrate_profile(args.step, args.collectives, args.machine)
        if args.quant:
            profile = dataclasses.replace(profile, quant_x_floor=x_floor_from_bench(args.quant))
    except ValueError as e:
        raise SystemExit(f"hsdp sim calibrate: {e}") from None
    profile.save(args.out)
    print(f"wrote {args.out}: {profile.tflops:.0f} TFLOP/s over {len(profile.class_tflops)} "
          f"phase classes, {profile.mem_gbps:.0f} GB/s, links: "
          f"{', '.join(profile.links) or 'none (emulated)'}")
    return 0


def resolve(args: argparse.Namespace) -> tuple[Setup, CostModel]:
    """The setup and cost model the arguments describe (SystemExit on bad values)."""
    try:
        base = PRESETS[args.model]
        overrides = {k: getattr(args, k) for k in MODEL_FIELDS
                     if getattr(args, k) is not None and hasattr(base, k)}
        if args.kv_heads is not None and not hasattr(base, "kv_heads"):
            raise ValueError(f"--kv-heads does not apply to {args.model}")
        outer, inner = args.mesh
        model = preset(args.model, **overrides)
        if args.experts:
            if not isinstance(model, LlamaConfig):
                raise ValueError(f"--experts needs a llama model, not {args.model}")
            model = MoEConfig(**{f.name: getattr(model, f.name) for f in
                                 dataclasses.fields(LlamaConfig) if f.init},
                              experts=args.experts, top_k=args.top_k, ep=args.ep)
        setup = Setup(model, outer, inner, args.strategy, True,
                      args.microbatches, args.mbs, args.dtype, args.reduce_dtype,
                      tp=args.tp, tp_gbps=args.tp_gbps, float8=args.float8,
                      outer_reduce=args.outer_reduce, outer_gather=args.outer_gather,
                      outer_sync=args.outer_sync)
        fabric = Fabric(Link(args.inner_gbps, args.latency_us),
                        Link(args.outer_gbps, args.latency_us))
        costs = CostModel(fabric, args.tflops, args.mem_gbps, args.host_us_per_op,
                          args.host_us_per_side_op, exclusive=dict.fromkeys(
                              COMMUNICATORS, args.exclusive))
        if args.calibrate_from and args.profile:
            raise ValueError("--calibrate-from and --profile exclude each other")
        if args.calibrate_from:
            costs = calibrate(args.calibrate_from, costs)
        if args.profile:
            profile = MachineProfile.load(args.profile)
            costs = profile.cost_model(profile.fabric(fabric))
        if args.float8:
            costs = dataclasses.replace(costs, float8_speedup=args.float8_speedup)
    except ValueError as e:
        raise SystemExit(f"hsdp sim: {str(e).removeprefix('sim: ')}") from None
    return setup, costs


def run(args: argparse.Namespace) -> int:
    setup, costs = resolve(args)
    if args.sweep:
        try:
            grid = parse_sweep(args.sweep)
        except ValueError as e:
            raise SystemExit(f"hsdp sim: {e}") from None
        report = run_sweep(setup, costs, grid)
        print_sweep(report)
        if args.png:
            from hsdp_tools.sim.sweep import plot_sweep

            plot_sweep(report, args.png)
    else:
        report, results = single(setup, costs)
        print_single(report)
        if args.png:
            from hsdp_tools.report.timeline import plot_timeline

            plot_timeline({name: r.intervals for name, r in results.items()}, args.png)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def single(setup: Setup, costs: CostModel) -> tuple[dict, dict[str, SimResult]]:
    """Overlapped and serialized schedules of ``setup``: the report and the results."""
    results = {name: simulate(dataclasses.replace(setup, overlap_outer=overlap), costs)
               for name, overlap in zip(SCHEDULE_NAMES[setup.strategy], (True, False),
                                        strict=True)}
    fast, slow = SCHEDULE_NAMES[setup.strategy]
    saving = results[slow].t_step_ms - results[fast].t_step_ms
    report = {
        "meta": meta(setup, costs),
        "schedules": {name: {"t_step_ms": r.t_step_ms,
                             **{k: r.metrics[k] for k in METRIC_KEYS[1:]},
                             "metrics": r.metrics,
                             "intervals": [dataclasses.asdict(iv) for iv in r.intervals]}
                      for name, r in results.items()},
        "summary": {f"{fast}_vs_{slow}": {
            "saving_ms": saving, "saving_pct": 100.0 * saving / results[slow].t_step_ms}},
    }
    return report, results


def meta(setup: Setup, costs: CostModel) -> dict:
    model = setup.model
    return {"model": {**dataclasses.asdict(model), "mbs": setup.mbs,
                      "microbatches": setup.microbatches, "dtype": setup.dtype,
                      "reduce_dtype": setup.reduce_dtype, "float8": setup.float8},
            "num_params": model.num_params,
            "mesh": {"outer": setup.outer, "inner": setup.inner} | (
                {"tp": setup.tp, "tp_gbps": setup.tp_gbps} if setup.tp > 1 else {}),
            "strategy": setup.strategy, "outer_reduce": setup.outer_reduce,
            "outer_gather": setup.outer_gather,
            "outer_sync": setup.outer_sync,
            "costs": {**dataclasses.asdict(costs)}}


def describe(m: dict) -> str:
    model, c = m["model"], m["costs"]
    f = c["fabric"]
    host = (f"measured phases ({len(c['phases'])})" if c["phases"] else
            f"host {c['host_us_per_op']:g} us/op")
    mesh = m["mesh"]
    tp = mesh.get("tp", 1)
    shape = (f"{mesh['outer']}x{mesh['inner']}x{tp} (outer x inner x tp, tp "
             f"{mesh['tp_gbps']:g} GB/s)" if tp > 1 else
             f"{mesh['outer']}x{mesh['inner']} (outer x inner)")
    return (f"{model['arch']} {m['num_params'] / 1e9:.2f} B params, {model['layers']} layers, "
            f"seq {model['seq']}, mbs {model['mbs']} x {model['microbatches']} microbatches, "
            f"{model['dtype']}{' + float8' if model.get('float8') else ''} / reduce "
            f"{model['reduce_dtype']}; mesh {shape}, {m['strategy']}; {c['tflops']:.0f} "
            f"TFLOP/s, {c['mem_gbps']:g} GB/s, {host}; outer reduction "
            f"{m.get('outer_reduce', 'none')}, outer gather {m.get('outer_gather', 'none')}, "
            f"outer sync {m.get('outer_sync', 'none')}; "
            f"inner {f['inner']['bus_gbps']:g} GB/s, "
            f"outer {f['outer']['bus_gbps']:g} GB/s, {f['inner']['latency_us']:g} us")


def print_single(report: dict) -> None:
    rows = [[name, *(f"{s[c]:.2f}" for c in METRIC_KEYS)]
            for name, s in report["schedules"].items()]
    notes = [f"{pair.replace('_vs_', ' vs ')}: saves {v['saving_ms']:.2f} ms per step "
             f"({v['saving_pct']:.1f}%)" for pair, v in report["summary"].items()]
    print_table(f"sim: {describe(report['meta'])}", ["schedule", *METRIC_KEYS], rows,
                [*notes, "lower bound = max(compute + last outer reduction, inner, outer busy)"])
