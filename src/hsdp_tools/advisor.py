"""Advise a mode for the outer axis: measure the links, price exact / int8 / DiLoCo.

``python -m hsdp advise --model llama-8b --mesh 2x2`` (spawns the mesh's ranks, or runs
under torchrun), or ``hsdp_tools.advise(model, mesh)`` inside a running job (every rank
calls it). It times the inner reduce-scatter and the outer all-reduce on the mesh's own
communicators at a few sizes (``bench collectives``' ops, a few seconds; progress on
rank 0's screen), fits a link to each (``sim.fabric.fit_link``), prices one step of each
mode with the simulator on that fabric and the machine profile (``--profile``; on a GPU
the committed profile of its card, else the simulator's defaults), and prints: mode,
predicted step time and its ratio to the communication-free step, outer bytes per step
and per rank, and the final-loss cost measured in our own convergence runs
(docs/results/cpu/*_convergence_4x2.json, cited per row).

The choice: the fastest mode, where every mode within ``TIE`` of it counts as as fast and
the one with the smallest convergence cost among them wins; a cost within the exact runs'
spread over seeds counts as none, and among equals the first of ``MODES`` (exact, int8,
DiLoCo H10, H50: the least departure from exact) wins. It is the same on every rank:
rank 0's measurement is broadcast before anything is priced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import hsdp
from hsdp.runtime.outer_modes import parse_mode
from hsdp.sharding.comm import Collectives
from hsdp.streams.stream_set import Streams
from hsdp.topology.communicators import comm_groups
from hsdp.topology.mesh import init_mesh
from hsdp_tools.bench.collectives import Buffers, parse_sizes, time_ms, variants
from hsdp_tools.bench.launch import launch, rank_process_group, select_cuda
from hsdp_tools.models import PRESETS, ModelConfig, preset
from hsdp_tools.report.args import parse_mesh
from hsdp_tools.report.table import print_table
from hsdp_tools.sim.costs import CostModel
from hsdp_tools.sim.engine import Setup, simulate
from hsdp_tools.sim.fabric import Fabric, Link, fit_link
from hsdp_tools.sim.profile import MachineProfile

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
TIE = 0.02  # modes within 2 % of the fastest count as as fast
CPU_SIZES, GPU_SIZES = "256KiB,1MiB,4MiB", "16MiB,64MiB,256MiB"


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way across the outer axis: the simulator's settings and the convergence run
    that measured its cost (file under docs/results/cpu, run name)."""

    name: str
    outer_reduce: str
    outer_sync: str
    run: tuple[str, str] | None  # None: the reference (exact)


MODES = (Mode("exact", "none", "none", None),
         Mode("int8", "int8", "none", ("outer_reduce_convergence_4x2.json", "int8+EF")),
         Mode("diloco H10", "none", "diloco:inner_steps=10,fragments={f}",
              ("diloco_convergence_4x2.json", "DiLoCo H10 F{f}")),
         Mode("diloco H50", "none", "diloco:inner_steps=50,fragments={f}",
              ("diloco_convergence_4x2.json", "DiLoCo H50 F{f}")))


def convergence_cost(run: tuple[str, str] | None, results: Path = RESULTS) -> dict:
    """The final loss (mean of each curve's last tenth, over seeds) of ``run`` against
    the exact run of the same file, in percent, with the exact seeds' spread."""
    if run is None:
        return {"pct": 0.0, "source": "reference"}
    path = results / "cpu" / run[0]
    curves = json.loads(path.read_text())["curves"]

    def final(name: str) -> list[float]:
        out = [statistics.fmean(c[-max(1, len(c) // 10):]) for k, c in curves.items()
               if k.endswith("/" + name)]
        if not out:
            raise ValueError(f"{path}: no run {name!r}")
        return out

    exact, got = final("exact"), final(run[1])
    ref = statistics.fmean(exact)
    return {"pct": 100.0 * (statistics.fmean(got) / ref - 1.0),
            "spread_pct": 100.0 * (max(exact) - min(exact)) / ref,
            "source": f"docs/results/cpu/{run[0]} ({run[1]})"}


def loss_cost(cost: dict) -> float:
    """``convergence_cost``'s percent where it exceeds the exact runs' own spread over
    seeds, else 0 (not told apart from exact by the runs)."""
    return cost["pct"] if cost["pct"] > cost.get("spread_pct", 0.0) else 0.0


def choose(rows: list[dict]) -> str:
    """The mode of ``rows`` (in ``MODES`` order) to use: the fastest, where those within
    ``TIE`` of it count as as fast and the smallest ``loss_cost`` among them wins, the
    first among equals."""
    fastest = min(r["t_step_ms"] for r in rows)
    tied = [r for r in rows if r["t_step_ms"] <= fastest * (1 + TIE)]
    return min(tied, key=lambda r: loss_cost(r["convergence"]))["mode"]


def measure(mesh: object, sizes: list[int], iters: int = 3,
            progress: Callable[[str], None] = print) -> dict[str, Link]:
    """The inner and outer links of ``mesh``'s own communicators (every rank calls it):
    inner reduce-scatters and outer all-reduces of ``sizes`` timed as ``bench
    collectives`` does (slowest rank, median of ``iters``), each fitted to a link;
    rank 0's result, broadcast."""
    g = comm_groups(mesh)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) \
        if mesh.device_type == "cuda" else torch.device("cpu")
    s, coll = Streams.create(device), Collectives()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    samples: dict[str, list[tuple[int, float]]] = {"rs": [], "ar": []}
    for i, size in enumerate(sizes):
        b = Buffers.allocate(size, g, dtype, device)
        todo = variants(s, coll, g, b)
        for name in samples:
            times = [time_ms(todo[name], s, device.type == "cuda") for _ in range(iters + 1)]
            worst = torch.tensor(times[1:], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            nbytes = b.full.numel() * b.full.element_size()
            samples[name].append((nbytes if name == "rs" else nbytes // g.inner_size,
                                  statistics.median(worst.tolist()) * 1e-3))
        if dist.get_rank() == 0:
            progress(f"advise: measured {i + 1}/{len(sizes)} sizes ({size / 2**20:g} MiB: "
                     f"inner RS {samples['rs'][-1][1] * 1e3:.2f} ms, outer AR "
                     f"{samples['ar'][-1][1] * 1e3:.2f} ms)")
    links = {}
    if g.inner_size > 1:
        links["inner"] = fit_link("reduce_scatter", g.inner_size, samples["rs"], 20.0)
    if g.outer_size > 1:
        links["outer"] = fit_link("all_reduce", g.outer_size, samples["ar"], 20.0)
    agreed = [links]
    dist.broadcast_object_list(agreed, src=0)
    return agreed[0]


def base_costs(profile: str | None, cuda: bool) -> CostModel:
    """The machine's cost model: ``profile``'s, else on a GPU the committed profile of
    its card (docs/results/<card>/profile.json) if there is one, else the defaults."""
    if profile is None and cuda:
        name = torch.cuda.get_device_name().lower()
        card = next((c for c in ("h200", "h100") if c in name), None)
        if card and (RESULTS / card / "profile.json").exists():
            profile = str(RESULTS / card / "profile.json")
    if profile is None:
        return CostModel(Fabric())
    p = MachineProfile.load(profile)
    return p.cost_model(p.fabric(Fabric()))


def price(model: ModelConfig, outer: int, inner: int, links: dict[str, Link],
          costs: CostModel, show: bool = True) -> dict:
    """Every mode's predicted step on ``links`` and the communication-free step, the
    convergence costs and the choice (module doc); in a process without a process group
    (the simulator's fake world)."""
    progress = print if show else (lambda _: None)
    fabric = Fabric(links.get("inner", costs.fabric.inner), links.get("outer", costs.fabric.outer))
    free = Fabric(Link(1e9, 0.0), Link(1e9, 0.0))
    base = Setup(model, outer, inner)
    # streaming DiLoCo in 4 fragments where they divide the model's units, else 1 (the
    # fragment counts our convergence runs measured)
    fragments = 4 if base.units() % 4 == 0 else 1
    progress("advise: pricing the communication-free step")
    t_free = simulate(base, dataclasses.replace(costs, fabric=free)).t_step_ms
    rows = []
    for m in MODES:
        progress(f"advise: pricing {m.name}")
        setup = dataclasses.replace(base, outer_reduce=m.outer_reduce,
                                    outer_sync=m.outer_sync.format(f=fragments))
        r = simulate(setup, dataclasses.replace(costs, fabric=fabric))
        run = None if m.run is None else (m.run[0], m.run[1].format(f=fragments))
        rows.append({"mode": m.name, "outer_reduce": setup.outer_reduce,
                     "outer_sync": setup.outer_sync, "t_step_ms": r.t_step_ms,
                     "vs_free": r.t_step_ms / t_free,
                     "outer_bytes_per_step": r.metrics["outer_bytes_per_step"],
                     "convergence": convergence_cost(run)})
    return {"mesh": [outer, inner], "model": dataclasses.asdict(model),
            "links": {"inner": dataclasses.asdict(fabric.inner),
                      "outer": dataclasses.asdict(fabric.outer)},
            "t_free_ms": t_free, "modes": rows, "choice": choose(rows)}


def print_advice(report: dict) -> None:
    rows = [[r["mode"] + (" *" if r["mode"] == report["choice"] else ""),
             f"{r['t_step_ms']:.2f}", f"{r['vs_free']:.2f}x",
             f"{r['outer_bytes_per_step'] / 2**20:.1f}",
             f"{r['convergence']['pct']:+.2f}%", r["convergence"]["source"]]
            for r in report["modes"]]
    li = report["links"]
    print_table(f"advise: mesh {report['mesh'][0]}x{report['mesh'][1]}, inner "
                f"{li['inner']['bus_gbps']:.2f} GB/s, outer {li['outer']['bus_gbps']:.2f} "
                f"GB/s; communication-free step {report['t_free_ms']:.2f} ms",
                ["mode", "step ms", "vs free", "outer MiB/step", "final loss", "measured in"],
                rows, [f"choice: {report['choice']} (the fastest; within {TIE:.0%} the "
                       f"smallest loss cost beyond the exact seeds' spread)"])


def model_config(model: nn.Module | ModelConfig | str) -> ModelConfig:
    """The simulator's config of ``model``: a preset name, a config, or a model built by
    ``hsdp_tools.models.build_model`` (its ``cfg``)."""
    if isinstance(model, str):
        return preset(model)
    cfg = getattr(getattr(model, "_orig_mod", model), "cfg", model)
    if not dataclasses.is_dataclass(cfg):
        raise TypeError("advise: pass a preset name, a ModelConfig or a model built by "
                        "hsdp_tools.models.build_model (its cfg), not "
                        f"{type(model).__name__}")
    return cfg


def advise(model: nn.Module | ModelConfig | str, mesh: object, *, profile: str | None = None,
           sizes: list[int] | None = None, links: dict[str, Link] | None = None,
           show: bool = True) -> dict:
    """Measure ``mesh``'s links (unless ``links`` are given), price every mode for
    ``model`` and return the report (printed on rank 0 with ``show``); every rank of the
    mesh calls it and gets the same report."""
    cuda = mesh.device_type == "cuda"
    say = print if show and dist.get_rank() == 0 else (lambda _: None)
    cfg = model_config(model)
    if links is None:
        links = measure(mesh, sizes or parse_sizes(GPU_SIZES if cuda else CPU_SIZES),
                        progress=say)
    g = comm_groups(mesh)
    agreed: list = [None]
    if dist.get_rank() == 0:  # the simulator needs a fake world: in a process of its own
        try:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as p:
                agreed[0] = p.submit(price, cfg, g.outer_size, g.inner_size,
                                     links, base_costs(profile, cuda), show).result()
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            agreed[0] = f"advise: pricing failed on rank 0: {type(e).__name__}: {e}"
    dist.broadcast_object_list(agreed, src=0)
    report = agreed[0]
    if isinstance(report, str):
        raise RuntimeError(report)
    if show and dist.get_rank() == 0:
        print_advice(report)
    return report


def choice_of(report: dict) -> hsdp.OuterChoice:
    """``report``'s choice as ``fully_shard``'s ``outer_reduce`` and ``init_mesh``'s
    ``outer_sync``, with the numbers behind it."""
    row = next(r for r in report["modes"] if r["mode"] == report["choice"])
    li = report["links"]
    priced = ", ".join(f"{r['mode']} {r['t_step_ms']:.2f} ms" for r in report["modes"])
    why = (f"advise: outer link {li['outer']['bus_gbps']:.2f} GB/s, inner "
           f"{li['inner']['bus_gbps']:.2f} GB/s; predicted step {priced} (communication-"
           f"free {report['t_free_ms']:.2f} ms); chose {row['mode']}: the fastest, within "
           f"{TIE:.0%} the smallest final-loss cost beyond the exact seeds' spread "
           f"({row['convergence']['pct']:+.2f}%, "
           f"{row['convergence']['source']})")
    return hsdp.OuterChoice(parse_mode("outer_reduce", row["outer_reduce"]),
                            parse_mode("outer_sync", row["outer_sync"]), why)


def auto(model: nn.Module | ModelConfig | str, *, profile: str | None = None,
         sizes: list[int] | None = None, links: dict[str, Link] | None = None) -> hsdp.Auto:
    """``outer_sync`` for ``init_mesh`` and ``outer_reduce`` for ``fully_shard`` (the same
    object to both): the mode ``advise`` chooses for ``model`` on the mesh, measured once
    on its communicators (``links``: priced instead of measured), the same on every rank
    and logged once with its numbers (``hsdp/outer_auto.py``)."""
    cfg = model_config(model)

    def chooser(mesh: object) -> hsdp.OuterChoice:
        return choice_of(advise(cfg, mesh, profile=profile, sizes=sizes, links=links,
                                show=False))

    return hsdp.Auto(chooser, name=f"hsdp_tools.auto({cfg.arch}, {cfg.layers} layers)")


# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=list(PRESETS), default="llama-8b")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layers")
    p.add_argument("--seq", type=int, default=None, help="override the preset's seq")
    p.add_argument("--mesh", type=parse_mesh, required=True, help="OUTERxINNER, e.g. 2x4")
    p.add_argument("--profile", default=None, metavar="JSON",
                   help="machine profile (`hsdp sim calibrate`; default on GPU: the "
                        "committed one of the card, else the simulator's defaults)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help=f"inner buffer sizes to time (default {GPU_SIZES} on GPU, "
                        f"{CPU_SIZES} on CPU)")
    p.add_argument("--outer-gbps", type=float, default=None,
                   help="price this outer bus bandwidth instead of the measured one")
    p.add_argument("--inner-gbps", type=float, default=None,
                   help="price this inner bus bandwidth instead of the measured one (with "
                        "--outer-gbps: nothing is measured, no ranks are started: prices "
                        "a mesh this machine cannot run, e.g. 16x8 on one GPU)")
    p.add_argument("--latency-us", type=float, default=20.0,
                   help="with --outer-gbps and --inner-gbps: the links' latency")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report here")


@dataclasses.dataclass(frozen=True)
class _Config:
    args: argparse.Namespace
    world: int
    cuda: bool


def run(args: argparse.Namespace) -> int:
    cuda = select_cuda(args.device, "advise")
    outer, inner = args.mesh
    if args.outer_gbps is not None and args.inner_gbps is not None:  # nothing to measure
        links = {"inner": Link(args.inner_gbps, args.latency_us),
                 "outer": Link(args.outer_gbps, args.latency_us)}
        report = price(_config(args), outer, inner, links, base_costs(args.profile, cuda))
        print_advice(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return 0

    def resolve(world: int) -> _Config:
        if world != outer * inner:
            raise SystemExit(f"hsdp advise: mesh {outer}x{inner} needs {outer * inner} "
                             f"ranks, the job has {world}")
        return _Config(args, world, cuda)

    return launch("advise", _worker, resolve, outer * inner, cuda, False)


def _config(args: argparse.Namespace) -> ModelConfig:
    return preset(args.model, **{k: v for k, v in (("layers", args.layers), ("seq", args.seq))
                                 if v})


def _worker(local_rank: int, cfg: _Config, port: int | None) -> None:
    a = cfg.args
    with rank_process_group(local_rank, cfg.world, port, cfg.cuda, None) as device:
        mesh = init_mesh(*a.mesh, device.type)
        say = print if dist.get_rank() == 0 else (lambda _: None)
        links = measure(mesh, a.sizes or parse_sizes(GPU_SIZES if cfg.cuda else CPU_SIZES),
                        progress=say)
        for axis, gbps in (("outer", a.outer_gbps), ("inner", a.inner_gbps)):
            if gbps is not None:
                links[axis] = Link(gbps, links[axis].latency_us if axis in links else 20.0)
        report = advise(_config(a), mesh, profile=a.profile, links=links)
        if dist.get_rank() == 0 and a.json:
            Path(a.json).write_text(json.dumps(report, indent=2))
