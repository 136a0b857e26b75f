"""Collectives bench: inner RS and outer AR alone, serialized and overlapped, plus pairs.

For each size (bytes of the full inner buffer, i.e. the inner reduce-scatter input):

- ``rs``: inner RS alone (rs stream, inner_rs communicator);
- ``ar``: outer AR alone of the RS output (size/inner; outer stream, outer communicator);
- ``serial``: RS then the AR of its output, both on the rs stream (the baseline);
- ``overlap``: RS on the rs stream concurrent with the AR of a separate buffer on the
  outer stream;
- ``outer_rs`` and ``hfsdp_pair``: outer RS of size/inner alone, and concurrent with
  the inner RS (the hfsdp gradient path);
- ``ag``, ``outer_ag`` and ``fwd_pair``: inner AG (size) and outer AG (size/inner) alone
  and concurrent (the hfsdp parameter path).

Timing: CUDA events on GPU, wall clock on CPU, each op between two barriers on the
default group (never on hsdp's communicators). The variants run interleaved within each
iteration; after warm-up each reports the median, min and max over iterations of the
slowest rank's time.

The default GPU sweep is 1 MiB to 1 GiB in steps of 4x. ``--max-ctas`` budgets SMs per
communicator; ``NCCL_LAUNCH_ORDER_IMPLICIT`` (set it in the environment) and the other NCCL
settings that change the result are recorded in the JSON and the table's title.
``--share-gpus``: several ranks per GPU (``hsdp_tools.bench.launch``), for correctness only.

``--shared-links`` (a 1 x N mesh): the outer communicator spans the same N ranks as the
inner ones, so that every pair above runs two communicators over the same links. On one
host with one rank per GPU this is how the concurrency of two communicators is measured
(a real outer axis would need more GPUs); the outer sizes stay those of an N x N mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from functools import partial

import torch
import torch.distributed as dist

from hsdp.sharding.comm import Collectives
from hsdp.streams.contract import SideStream
from hsdp.streams.op_table import OpKind, op_table
from hsdp.streams.stream_set import Streams
from hsdp.topology.communicators import CommGroups, NcclConfig, comm_groups, new_communicator
from hsdp.topology.mesh import init_mesh
from hsdp_tools.bench.launch import (
    RECORDED_ENV,
    SHARED_LAYOUT_NOTE,
    add_layout_argument,
    bookkeeping_device,
    check_shared_layout,
    host_barrier,
    launch,
    rank_process_group,
    select_cuda,
)
from hsdp_tools.report.args import DTYPES, parse_mesh
from hsdp_tools.report.table import print_table as print_rows

# Multicast (NVLS) off on multi-GPU machines: see docs/design.md ("Testing on CPU and GPU").
UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
GPU_SIZES = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB"
VARIANTS = ("rs", "ar", "serial", "overlap", "outer_rs", "hfsdp_pair", "ag", "outer_ag",
            "fwd_pair")

Part = tuple[SideStream, str, Callable[[], None]]  # (stream, label, op)


# --------------------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to spawn (default: all GPUs, twice that with "
                        "--share-gpus, or 4 on CPU); ignored under torchrun")
    p.add_argument("--mesh", type=parse_mesh, default=None,
                   help="OUTERxINNER, e.g. 2x4 (default: 2 x world/2)")
    add_layout_argument(p)
    p.add_argument("--shared-links", action="store_true",
                   help="1xN mesh: the outer communicator spans the inner ranks too, to "
                        "measure two communicators on the same links")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help=f"inner buffer sizes, e.g. 64MiB,256MiB,1GiB "
                        f"(default: {GPU_SIZES} on GPU, 256KiB,1MiB,4MiB on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--iters", type=int, default=20, help="timed iterations")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    p.add_argument("--json", default=None, metavar="PATH", help="write results here")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: gloo ranks even where GPUs exist (default: cuda when present)")
    p.add_argument("--max-ctas", type=parse_max_ctas, default=None, metavar="inner=N,outer=M",
                   help="NCCL max CTAs per communicator (inner applies to inner_ag and "
                        "inner_rs)")


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864; units B, KiB, MiB, GiB (or none: bytes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: expected an integer with an optional unit among "
            f"{', '.join(u for u in UNITS if u)}")
    return int(m.group(1)) * UNITS[m.group(2) or ""]


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def format_size(nbytes: int) -> str:
    """The largest unit that divides ``nbytes`` exactly: 1048576 -> ``"1MiB"``."""
    for unit in ("GiB", "MiB", "KiB"):
        if nbytes % UNITS[unit] == 0 and nbytes >= UNITS[unit]:
            return f"{nbytes // UNITS[unit]}{unit}"
    return f"{nbytes}B"


def parse_max_ctas(text: str) -> dict[str, NcclConfig]:
    """``"inner=8,outer=4"`` -> NcclConfig per hsdp communicator."""
    per_axis: dict[str, int] = {}
    for item in text.split(","):
        m = re.fullmatch(r"\s*(inner|outer)\s*=\s*(\d+)\s*", item)
        if not m:
            raise argparse.ArgumentTypeError(
                f"bad --max-ctas item {item!r}: expected inner=N or outer=M")
        per_axis[m.group(1)] = int(m.group(2))
    out = {}
    if "inner" in per_axis:
        out["inner_ag"] = out["inner_rs"] = NcclConfig(max_ctas=per_axis["inner"])
    if "outer" in per_axis:
        out["outer"] = NcclConfig(max_ctas=per_axis["outer"])
    return out


def default_mesh(world: int) -> tuple[int, int]:
    """2 x world/2 when the world is even and at least 2, else 1 x world."""
    return (2, world // 2) if world >= 2 and world % 2 == 0 else (1, world)


@dataclass(frozen=True)
class CollectivesBenchConfig:
    """``bench collectives``' resolved arguments, identical on every rank."""

    world: int
    outer: int
    inner: int
    sizes: tuple[int, ...]
    dtype: str
    iters: int
    warmup: int
    max_ctas: dict[str, NcclConfig] | None
    json_path: str | None
    cuda: bool
    share_gpus: bool = False
    shared_links: bool = False


def resolve(args: argparse.Namespace, cuda: bool, world: int) -> CollectivesBenchConfig:
    """Fill defaults that depend on the device and the world size; check the rest."""
    if world < 1:
        raise SystemExit(f"hsdp bench collectives: need at least one rank, got {world}")
    outer, inner = args.mesh or default_mesh(world)
    if outer * inner != world:
        raise SystemExit(f"hsdp bench collectives: mesh {outer}x{inner} has {outer * inner} "
                         f"ranks but the job has {world}")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("hsdp bench collectives: need --iters >= 1 and --warmup >= 0")
    if args.shared_links and (outer != 1 or inner < 2):
        raise SystemExit(f"hsdp bench collectives: --shared-links needs a 1xN mesh with N >= 2 "
                         f"(the outer communicator spans the inner ranks); got {outer}x{inner}")
    share = bool(args.share_gpus) and cuda
    if share:
        check_shared_layout("bench collectives", outer, inner, torch.cuda.device_count())
    sizes = args.sizes or parse_sizes(GPU_SIZES if cuda else "256KiB,1MiB,4MiB")
    return CollectivesBenchConfig(world, outer, inner, tuple(sizes),
                                  args.dtype or ("bf16" if cuda else "fp32"), args.iters,
                                  args.warmup, args.max_ctas, args.json, cuda, share,
                                  bool(args.shared_links))


# --------------------------------------------------------------------------- launch


def run(args: argparse.Namespace) -> int:
    """Entry point: run in place under torchrun, else spawn local ranks."""
    cuda = select_cuda(args.device, "bench collectives")
    return launch("bench collectives", _worker, lambda world: resolve(args, cuda, world),
                  args.nproc, cuda, bool(args.share_gpus))


def _worker(local_rank: int, cfg: CollectivesBenchConfig, port: int | None) -> None:
    with rank_process_group(local_rank, cfg.world, port, cfg.cuda,
                            cfg.inner if cfg.share_gpus else None) as device:
        rows = bench(cfg, device)
        if dist.get_rank() == 0:
            result = {"meta": _meta(cfg, device), "rows": rows}
            print_table(result)
            if cfg.json_path:
                with open(cfg.json_path, "w") as f:
                    json.dump(result, f, indent=2)


# --------------------------------------------------------------------------- bench


@dataclass
class Buffers:
    """Per-size tensors; ops that run at once never share one."""

    full: torch.Tensor   # size: inner RS input, inner AG output
    shard: torch.Tensor  # size/inner: inner RS output, inner AG input, serial AR
    other: torch.Tensor  # size/inner: overlapped AR, outer RS input, outer AG output
    small: torch.Tensor  # size/(inner*outer): outer RS output, outer AG input

    @staticmethod
    def allocate(size: int, g: CommGroups, dtype: torch.dtype,
                 device: torch.device) -> Buffers:
        """``size`` bytes, rounded down to a multiple of the world's elements."""
        numel = size // dtype.itemsize // g.world * g.world
        if numel == 0:
            raise SystemExit(f"hsdp bench collectives: size {size} B is below one "
                             f"{dtype} element per rank")

        def zeros(n: int) -> torch.Tensor:  # zeros: repeated sums stay finite
            return torch.zeros(n, dtype=dtype, device=device)

        return Buffers(zeros(numel), zeros(numel // g.inner_size),
                       zeros(numel // g.inner_size), zeros(numel // g.world))


def variants(s: Streams, coll: Collectives, g: CommGroups,
             b: Buffers) -> dict[str, list[Part]]:
    """Each variant: the ops to start together; ops on one stream run in order."""
    rs = partial(coll.reduce_scatter, b.shard, b.full, g.inner_rs, "inner")
    ar_shard = partial(coll.all_reduce, b.shard, g.outer, "outer")
    ar_other = partial(coll.all_reduce, b.other, g.outer, "outer")
    outer_rs = partial(coll.reduce_scatter, b.small, b.other, g.outer, "outer")
    ag = partial(coll.all_gather, b.full, b.shard, g.inner_ag, "inner")
    outer_ag = partial(coll.all_gather, b.other, b.small, g.outer, "outer")
    overlapped, serialized = op_table(overlap_outer=True), op_table(overlap_outer=False)

    def part(kind: OpKind, fn: Callable[[], None], table: dict = overlapped) -> Part:
        """``fn`` on the stream and with the label the runtime's op table gives ``kind``."""
        op = table[kind]
        return getattr(s, op.stream), op.label, fn

    k = OpKind
    return {
        "rs": [part(k.REDUCE_SCATTER, rs)],
        "ar": [part(k.OUTER_ALL_REDUCE, ar_shard)],
        "serial": [part(k.REDUCE_SCATTER, rs, serialized),
                   part(k.OUTER_ALL_REDUCE, ar_shard, serialized)],
        "overlap": [part(k.REDUCE_SCATTER, rs), part(k.OUTER_ALL_REDUCE, ar_other)],
        "outer_rs": [part(k.OUTER_REDUCE_SCATTER, outer_rs)],
        "hfsdp_pair": [part(k.REDUCE_SCATTER, rs), part(k.OUTER_REDUCE_SCATTER, outer_rs)],
        "ag": [part(k.GATHER, ag)],
        "outer_ag": [part(k.OUTER_ALL_GATHER, outer_ag)],
        "fwd_pair": [part(k.GATHER, ag), part(k.OUTER_ALL_GATHER, outer_ag)],
    }


def time_ms(parts: list[Part], s: Streams, cuda: bool) -> float:
    """Start ``parts`` together from the compute stream and time until all have finished."""
    host_barrier()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    ready = s.compute.record()
    for ev in [stream.submit(op, after=[ready], label=label) for stream, label, op in parts]:
        s.compute.wait(ev)
    if cuda:
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
    else:
        ms = (time.perf_counter() - t0) * 1e3
    host_barrier()
    return ms


def bench(cfg: CollectivesBenchConfig, device: torch.device) -> list[dict]:
    """All sizes on this rank; returns the rows (same on every rank)."""
    mesh = init_mesh(cfg.outer, cfg.inner, device.type, nccl=cfg.max_ctas)
    g = comm_groups(mesh)
    if cfg.shared_links:
        outer = new_communicator(list(range(cfg.world)), device.type,
                                 (cfg.max_ctas or {}).get("outer"))
        g = replace(g, outer_size=g.inner_size, outer_rank=g.inner_rank, outer=outer)
    s = Streams.create(device)
    coll = Collectives()
    rows = []
    for size in cfg.sizes:
        b = Buffers.allocate(size, g, DTYPES[cfg.dtype], device)
        todo = variants(s, coll, g, b)
        samples: dict[str, list[float]] = {name: [] for name in todo}
        for it in range(cfg.warmup + cfg.iters):
            for name, parts in todo.items():  # interleaved: A B C ... A B C ...
                ms = time_ms(parts, s, device.type == "cuda")
                if it >= cfg.warmup:
                    samples[name].append(ms)
        worst = torch.tensor([samples[n] for n in VARIANTS], dtype=torch.float64,
                             device=bookkeeping_device(device))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # slowest rank, per iteration
        rows.append(make_row(b.full.numel() * b.full.element_size(),
                             dict(zip(VARIANTS, worst.tolist(), strict=True))))
    return rows


def make_row(size_bytes: int, samples: dict[str, list[float]]) -> dict:
    """One JSON row: ``t_{variant}_ms`` (median), ``_min_ms``, ``_max_ms`` and ratios."""
    row: dict = {"size_bytes": size_bytes}
    for name in VARIANTS:
        row[f"t_{name}_ms"] = statistics.median(samples[name])
        row[f"t_{name}_min_ms"] = min(samples[name])
        row[f"t_{name}_max_ms"] = max(samples[name])

    def t(name: str) -> float:
        return row[f"t_{name}_ms"]

    row["saving_pct"] = 100.0 * (1.0 - t("overlap") / t("serial"))
    row["overlap_over_max"] = t("overlap") / max(t("rs"), t("ar"))
    row["hfsdp_pair_over_max"] = t("hfsdp_pair") / max(t("rs"), t("outer_rs"))
    row["fwd_pair_over_max"] = t("fwd_pair") / max(t("ag"), t("outer_ag"))
    return row


# --------------------------------------------------------------------------- report


def _meta(cfg: CollectivesBenchConfig, device: torch.device) -> dict:
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": str(dist.get_backend()),
        "device": device.type,
        "timing": ("CUDA events" if device.type == "cuda" else "wall clock") +
                  "; median/min/max over iterations of the max over ranks",
        "layout": SHARED_LAYOUT_NOTE if cfg.share_gpus else "one rank per device",
        "links": ("shared: the outer communicator spans the inner ranks" if cfg.shared_links
                  else "separate: outer and inner communicators"),
        "env": {k: os.environ.get(k) for k in RECORDED_ENV},
        **{k: v for k, v in asdict(cfg).items() if k != "json_path"},
    }
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version()
        meta.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    return meta


COLUMNS = (  # (header, row key, format)
    ("size", "size_bytes", format_size),
    ("RS ms", "t_rs_ms", "{:.3f}".format),
    ("AR ms", "t_ar_ms", "{:.3f}".format),
    ("serial ms", "t_serial_ms", "{:.3f}".format),
    ("overlapped ms", "t_overlap_ms", "{:.3f}".format),
    ("saving %", "saving_pct", "{:.1f}".format),
    ("ovl/max", "overlap_over_max", "{:.2f}".format),
    ("hfsdp pair ms", "t_hfsdp_pair_ms", "{:.3f}".format),
    ("hfsdp/max", "hfsdp_pair_over_max", "{:.2f}".format),
    ("fwd pair ms", "t_fwd_pair_ms", "{:.3f}".format),
    ("fwd/max", "fwd_pair_over_max", "{:.2f}".format),
)


def print_table(result: dict) -> None:
    """Rank 0's summary table (``rich`` when importable)."""
    m = result["meta"]
    title = (f"collectives: mesh {m['outer']}x{m['inner']} (outer x inner), {m['dtype']}, "
             f"{m['backend']}, median of {m['iters']}, slowest rank")
    if m.get("nccl"):
        settings = {k: v for k, v in m["env"].items() if k.startswith("NCCL_") and v}
        ctas = {k: v["max_ctas"] for k, v in (m["max_ctas"] or {}).items()}
        title += (f", NCCL {m['nccl']}; max CTAs {ctas or 'default'}; "
                  + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
    if m["shared_links"]:
        title += "; outer communicator over the inner ranks (shared links)"
    if m["layout"] == SHARED_LAYOUT_NOTE:
        title += f" -- {SHARED_LAYOUT_NOTE}"
    cells = [[fmt(row[key]) for _, key, fmt in COLUMNS] for row in result["rows"]]
    headers = [h for h, _, _ in COLUMNS]
    print_rows(title, headers, cells)
