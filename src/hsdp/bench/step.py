"""Step bench: training step time of hsdp's schedules and torch FSDP2 on one GPT.

Schedules (same outer x inner mesh, same seed, same synthetic tokens; each block is a
unit, the root last):

- ``overlap``: hsdp, outer all-reduce on its own stream (``overlap_outer=True``);
- ``serial``: hsdp, outer all-reduce on the rs stream (the baseline of schedule.md);
- ``hfsdp`` / ``hfsdp-serial``: the same with strategy hfsdp;
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on the same 2-D mesh (HSDP).

Timing: every model is built first; then ``--warmup`` untimed steps per schedule, one
schedule at a time (which also sizes each model's resident memory); then the schedules
take turns, one step each (A B C A B C ...), ``--steps`` times. A step (all microbatches,
``optimizer.step()``) is timed on the wall clock from a barrier to the point where every
stream of its schedule is idle (hsdp's side streams drained, ``torch.cuda.synchronize``
on GPU) and a barrier; the slowest rank counts. hfsdp's outer all-gather after the
optimizer step therefore counts in full: interleaving leaves it nothing to overlap.
tokens/s = global tokens per step (world x mbs x seq x microbatches) / median step time.

Memory (GPU): ``torch.cuda.max_memory_allocated`` over the schedule's timed steps, less
what the other schedules' models hold meanwhile: each model's resident memory (after it
was built and warmed up, one at a time) is known, so the figure is what this schedule
would need alone. On CPU: null.

Trace: one more step per schedule under ``torch.profiler`` with the schedule's tracer on
(hsdp's root unit tracer; for fsdp2 its collectives are wrapped, see
``hsdp.bench.fsdp2``). GPU: its Chrome trace gives the intervals. CPU: the intervals come
from the stream records of one extra step per schedule without the profiler (whose per-op
cost is large next to small CPU ops), all taken before the first profiled step. Rank 0
measures them with ``hsdp.report.metrics.step_metrics`` and writes the Chrome traces and
one timeline PNG to ``--out-dir``.

Lower bound: ``max(compute + tail, inner, outer)`` from each schedule's traced step,
with compute / inner / outer the busy time of each resource and tail the duration of
the last outer reduction (it cannot start before the last backward kernel ends; the
floor of ``outer_tail`` in schedule.md). This is schedule.md's ``max(compute, inner,
outer) + tail`` with the tail attached to the compute chain it must follow, which keeps
it a true bound when communication dominates.

``--emulate``: one process posing as rank 0 of the mesh (torch's fake process group);
every collective first waits its modelled duration (``hsdp.fabric.Fabric``) on its own
stream: ``torch.cuda._sleep`` on GPU (calibrated; the error is reported), host sleeps on
hsdp's stream threads on CPU. ``--fabric-json`` fits the fabric to a ``bench
collectives`` JSON (see ``fabric_from_collectives``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import hsdp
from hsdp.bench.collectives import DTYPES, default_mesh
from hsdp.bench.emulate import emulate, fake_mesh
from hsdp.bench.fsdp2 import fsdp2_collectives, shard_fsdp2
from hsdp.bench.launch import NCCL_ENV, launch, rank_process_group, select_cuda
from hsdp.bench.trace import intervals_from_chrome_trace, intervals_from_records
from hsdp.comm import SleepClock
from hsdp.fabric import Fabric, Link
from hsdp.models import CHECKPOINT_MODES, GPTConfig, build_model, lm_loss
from hsdp.report.args import parse_mesh
from hsdp.report.metrics import Interval, step_metrics
from hsdp.report.table import print_table as print_rows
from hsdp.report.timeline import plot_timeline
from hsdp.streams import OpRecord, Tracer

# schedule -> (strategy, overlap_outer); None: torch FSDP2
SCHEDULES: dict[str, tuple[str, bool] | None] = {
    "overlap": ("hsdp", True), "serial": ("hsdp", False),
    "hfsdp": ("hfsdp", True), "hfsdp-serial": ("hfsdp", False), "fsdp2": None}
# (overlapped, serialized) pairs whose saving is reported
PAIRS = (("overlap", "serial"), ("hfsdp", "hfsdp-serial"))
# Model sizes when not given. GPU: Llama-8B-sized layers (no SwiGLU, no GQA), enough
# compute per layer that an H200 is not waiting on the host; CPU: quick.
MODEL_DEFAULTS = {
    "cuda": {"layers": 8, "hidden": 4096, "heads": 32, "ffn": 14336, "vocab": 32768,
             "seq": 2048, "mbs": 1},
    "cpu": {"layers": 4, "hidden": 128, "heads": 4, "ffn": 512, "vocab": 1024, "seq": 128,
            "mbs": 2},
}
EMULATED_MESH = {"cuda": (16, 8), "cpu": (2, 4)}  # --emulate without --mesh
GIB = 1 << 30


# --------------------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser,
                  model_defaults: dict[str, dict[str, int]] = MODEL_DEFAULTS) -> None:
    """The options; ``model_defaults`` (per device type) fill the model sizes not given."""
    p.set_defaults(model_defaults=model_defaults)
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to spawn (default: all GPUs, or 4 on CPU); "
                        "ignored under torchrun and with --emulate")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: gloo ranks even where GPUs exist (default: cuda when present)")
    p.add_argument("--mesh", type=parse_mesh, default=None,
                   help="OUTERxINNER (default: 2 x world/2; with --emulate 16x8 on GPU, "
                        "2x4 on CPU)")
    model = p.add_argument_group("model (defaults: GPU / CPU)")
    for name, help_ in (("layers", "transformer blocks"), ("hidden", "hidden size"),
                        ("heads", "attention heads"), ("ffn", "MLP size"),
                        ("vocab", "vocabulary size"), ("seq", "sequence length"),
                        ("mbs", "micro-batch size (sequences per rank)")):
        d = f"{model_defaults['cuda'][name]} / {model_defaults['cpu'][name]}"
        model.add_argument(f"--{name}", type=int, default=None, help=f"{help_} ({d})")
    model.add_argument("--checkpoint", choices=CHECKPOINT_MODES, default="none",
                       help="activation checkpointing (see hsdp.models.GPTConfig)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="microbatches per step (outer reduction on the last only)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="parameter dtype for compute (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32",
                   help="gradient reduction dtype")
    p.add_argument("--schedules", type=parse_schedules, default=parse_schedules(
        "overlap,serial,fsdp2"), help=f"comma-separated among {', '.join(SCHEDULES)} "
                                      f"(default: overlap,serial,fsdp2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per schedule first")
    emu = p.add_argument_group("emulation")
    emu.add_argument("--emulate", action="store_true",
                     help="one process posing as the whole mesh, modelled collective times")
    emu.add_argument("--inner-gbps", type=float, default=370.0, help="inner bus GB/s")
    emu.add_argument("--outer-gbps", type=float, default=47.0, help="outer bus GB/s")
    emu.add_argument("--latency-us", type=float, default=20.0, help="per collective, us")
    emu.add_argument("--fabric-json", default=None, metavar="PATH",
                     help="fit inner/outer bandwidth to a `bench collectives` JSON instead")
    p.add_argument("--json", default=None, metavar="PATH", help="write results here")
    p.add_argument("--out-dir", default="out/bench_step",
                   help="Chrome traces and timeline.png (default: ./out/bench_step)")


def parse_schedules(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [n for n in names if n not in SCHEDULES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"bad --schedules {text!r}: expected distinct names among {', '.join(SCHEDULES)}")
    return names


def fabric_from_collectives(path: str | Path, latency_us: float) -> Fabric:
    """A ``Fabric`` fitted to the largest row of a ``bench collectives`` JSON.

    Same bus-bandwidth convention as ``fabric.py``: a collective takes ``latency + f *
    nbytes / busbw``. Inner: the reduce-scatter ``t_rs_ms`` of ``size_bytes`` (its input)
    over the inner group; outer: the all-reduce ``t_ar_ms`` of ``size_bytes / inner``
    (the RS output) over the outer group. Each bus bandwidth is solved for so that the
    model, with ``latency_us`` added, reproduces the measured median at that size.
    """
    data = json.loads(Path(path).read_text())
    inner, outer = data["meta"]["inner"], data["meta"]["outer"]
    row = max(data["rows"], key=lambda r: r["size_bytes"])
    unit = Fabric(Link(1.0, 0.0), Link(1.0, 0.0))  # 1 GB/s, no latency: seconds = f*bytes/1e9

    def link(kind: str, axis: str, nbytes: int, n: int, ms: float) -> Link:
        if n < 2:
            raise SystemExit(f"hsdp bench step: {path} has a {axis} group of {n} rank; "
                             f"nothing to fit the {axis} bandwidth on")
        moving = ms * 1e-3 - latency_us * 1e-6
        if moving <= 0:
            raise SystemExit(f"hsdp bench step: {path}: {kind} of {nbytes} B took {ms} ms, "
                             f"not more than --latency-us {latency_us}")
        return Link(unit.seconds(kind, axis, nbytes, n) / moving, latency_us)

    return Fabric(link("reduce_scatter", "inner", row["size_bytes"], inner, row["t_rs_ms"]),
                  link("all_reduce", "outer", row["size_bytes"] // inner, outer,
                       row["t_ar_ms"]))


@dataclass(frozen=True)
class Config:
    """Resolved arguments, identical on every rank."""

    world: int
    outer: int
    inner: int
    model: GPTConfig
    mbs: int
    microbatches: int
    dtype: str
    reduce_dtype: str
    schedules: tuple[str, ...]
    steps: int
    warmup: int
    emulate: bool
    fabric: Fabric | None
    fabric_source: str | None
    json_path: str | None
    out_dir: str
    cuda: bool

    @property
    def global_tokens(self) -> int:
        return self.world * self.mbs * self.model.seq * self.microbatches

    def describe(self) -> str:
        m = self.model
        return (f"GPT {m.layers} layers, hidden {m.hidden}, ffn {m.ffn}, heads {m.heads}, "
                f"vocab {m.vocab}, seq {m.seq}, mbs {self.mbs}, {self.dtype}: "
                f"{m.num_params / 1e6:.1f} M params")


def resolve(args: argparse.Namespace, cuda: bool, world: int | None) -> Config:
    """Fill defaults that depend on the device and world; check the rest. ``world`` is
    None with ``--emulate`` (the mesh decides it)."""
    def fail(msg: str) -> SystemExit:
        return SystemExit(f"hsdp bench step: {msg}")

    device = "cuda" if cuda else "cpu"
    if world is None:
        outer, inner = args.mesh or EMULATED_MESH[device]
        world = outer * inner
    else:
        if world < 1:
            raise fail(f"need at least one rank, got {world}")
        outer, inner = args.mesh or default_mesh(world)
        if outer * inner != world:
            raise fail(f"mesh {outer}x{inner} has {outer * inner} ranks but the job has "
                       f"{world}; pick --mesh OUTERxINNER with OUTER*INNER = {world} "
                       f"(or --nproc {outer * inner})")
    if args.steps < 1 or args.warmup < 1 or args.microbatches < 1:
        raise fail("need --steps >= 1, --warmup >= 1 (the first step records the unit "
                   "order and creates optimizer state) and --microbatches >= 1")
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v
             for k, v in args.model_defaults[device].items()}
    mbs = sizes.pop("mbs")
    try:
        model = GPTConfig(checkpoint=args.checkpoint, **sizes)
    except ValueError as e:
        raise fail(str(e)) from None
    fabric, source = None, None
    if args.emulate and args.fabric_json:
        fabric = fabric_from_collectives(args.fabric_json, args.latency_us)
        source = args.fabric_json
    elif args.emulate:
        fabric = Fabric(Link(args.inner_gbps, args.latency_us),
                        Link(args.outer_gbps, args.latency_us))
        source = "flags"
    return Config(world, outer, inner, model, mbs, args.microbatches,
                  args.dtype or ("bf16" if cuda else "fp32"), args.reduce_dtype,
                  tuple(args.schedules), args.steps, args.warmup, args.emulate, fabric,
                  source, args.json, args.out_dir, cuda)


# --------------------------------------------------------------------------- launch


def run(args: argparse.Namespace) -> int:
    """Entry point: one emulating process, in place under torchrun, or spawned ranks."""
    cuda = select_cuda(args.device, "bench step")
    if args.emulate:
        cfg = resolve(args, cuda, None)
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        mesh = fake_mesh(cfg.outer, cfg.inner, device.type)
        try:
            _report(bench(cfg, device, mesh), cfg)
        finally:
            dist.destroy_process_group()
        return 0
    return launch("bench step", _worker, lambda world: resolve(args, cuda, world), args.nproc,
                  cuda)


def _worker(local_rank: int, cfg: Config, port: int | None) -> None:
    with rank_process_group(local_rank, cfg.world, port, cfg.cuda) as device:
        mesh = hsdp.init_mesh(cfg.outer, cfg.inner, device.type)
        result = bench(cfg, device, mesh)
        if dist.get_rank() == 0:
            _report(result, cfg)


@contextmanager
def _oom_guard(schedule: str, cfg: Config) -> Iterator[None]:
    """Turn a CUDA out-of-memory error into a clear exit naming the schedule and model."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        raise SystemExit(f"hsdp bench step: out of memory on rank {dist.get_rank()} in "
                         f"schedule {schedule!r} with {cfg.describe()} on mesh "
                         f"{cfg.outer}x{cfg.inner}: {str(e).splitlines()[0]}") from None


# --------------------------------------------------------------------------- trainees


@dataclass
class Trainee:
    """One schedule's model, optimizer and measurements on this rank."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    tracer: Tracer
    comm: Callable[[], AbstractContextManager]  # around each step (fsdp2's wrappers)
    calibration_error: float | None
    samples_ms: list[float] = field(default_factory=list)
    resident_bytes: int = 0
    peak_bytes: int = 0

    @property
    def is_hsdp(self) -> bool:
        return SCHEDULES[self.name] is not None

    def step(self, batches: list[torch.Tensor]) -> None:
        """One optimizer step over all microbatches; returns once every stream is idle."""
        last = len(batches) - 1
        with self.comm():
            for m, tokens in enumerate(batches):
                if self.is_hsdp:
                    ctx = hsdp.microbatch(self.model, is_last=m == last)
                else:
                    self.model.set_requires_all_reduce(m == last, recurse=True)
                    ctx = nullcontext()
                with ctx:
                    (lm_loss(self.model(tokens), tokens) / len(batches)).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.is_hsdp:
                self.model._hsdp_unit.runtime.synchronize()
            if batches[0].is_cuda:
                torch.cuda.synchronize()


def build(name: str, cfg: Config, mesh: DeviceMesh, device: torch.device) -> Trainee:
    """The schedule's sharded model (seed 0) and its AdamW."""
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg.model)
    mpol = hsdp.MixedPrecision(DTYPES[cfg.dtype], DTYPES[cfg.reduce_dtype])
    schedule = SCHEDULES[name]
    tracer = Tracer()
    comm: Callable[[], AbstractContextManager] = nullcontext
    error = None
    if schedule is None:
        shard_fsdp2(model, list(model.blocks), mesh, mpol)
        sleep = time.sleep
        if cfg.fabric is not None and device.type == "cuda":
            clock = SleepClock.calibrate(device)
            sleep, error = clock, clock.check()
        comm = partial(fsdp2_collectives, mesh, tracer, cfg.fabric, sleep)
    else:
        strategy, overlap = schedule
        for blk in model.blocks:
            hsdp.fully_shard(blk, mesh=mesh, strategy=strategy, mp_policy=mpol,
                             overlap_outer=overlap)
        hsdp.fully_shard(model, mesh=mesh, strategy=strategy, mp_policy=mpol,
                         overlap_outer=overlap)
        tracer = model._hsdp_unit.tracer
        if cfg.emulate:
            error = emulate(model, cfg.fabric, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return Trainee(name, model, opt, tracer, comm, error)


def synthetic_batches(cfg: Config, device: torch.device) -> list[torch.Tensor]:
    """This rank's token batches, one per microbatch (the same for every schedule)."""
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    return [torch.randint(0, cfg.model.vocab, (cfg.mbs, cfg.model.seq), generator=g)
            .to(device) for _ in range(cfg.microbatches)]


# --------------------------------------------------------------------------- bench


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def bench(cfg: Config, device: torch.device, mesh: DeviceMesh) -> dict:
    """Build, warm up, time (interleaved) and trace every schedule; the result dict on
    rank 0 (partial on the others)."""
    cuda = device.type == "cuda"
    batches = synthetic_batches(cfg, device)
    per_schedule = cfg.warmup + cfg.steps + (2 if cuda else 3)
    with _progress(len(cfg.schedules) * per_schedule) as advance:
        trainees = []
        for name in cfg.schedules:
            with _oom_guard(name, cfg):
                before = _allocated(device)
                trainees.append(build(name, cfg, mesh, device))
                trainees[-1].resident_bytes = _allocated(device) - before
            advance(f"built {name}")
        for t in trainees:
            with _oom_guard(t.name, cfg):
                before = _allocated(device)
                for _ in range(cfg.warmup):
                    t.step(batches)
                    advance(f"warm-up {t.name}")
                t.resident_bytes += _allocated(device) - before
        for _ in range(cfg.steps):
            for t in trainees:  # interleaved: A B C A B C ...
                with _oom_guard(t.name, cfg):
                    _timed_step(t, batches, device)
                advance(f"step {t.name}")
        # CPU: the metrics' records come from steps without the profiler (its per-op cost
        # is large next to small CPU ops), all taken before the first profiled step.
        recorded = {}
        for t in [] if cuda else trainees:
            dist.barrier()
            recorded[t.name] = _recorded_step(t, batches)
            advance(f"record {t.name}")
        traces = {}
        for t in trainees:
            with _oom_guard(t.name, cfg):
                traces[t.name] = _trace(t, batches, cfg, recorded.get(t.name))
            advance(f"trace {t.name}")
    return _results(cfg, device, trainees, traces)


def _timed_step(t: Trainee, batches: list[torch.Tensor], device: torch.device) -> None:
    cuda = device.type == "cuda"
    dist.barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    others = _allocated(device) - t.resident_bytes  # held by the other schedules' models
    t0 = time.perf_counter()
    t.step(batches)
    dist.barrier()
    t.samples_ms.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        t.peak_bytes = max(t.peak_bytes, torch.cuda.max_memory_allocated(device) - others)


def _trace(t: Trainee, batches: list[torch.Tensor], cfg: Config,
           recorded: tuple[list[OpRecord], float, float] | None) -> tuple[list[Interval],
                                                                          str | None]:
    """Profile one step; rank 0 returns its intervals and Chrome trace path. Intervals:
    from the CUDA trace, or from the CPU stream records ``recorded`` (records, t0, t1)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = recorded is None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        _recorded_step(t, batches)  # on CUDA, the tracer adds the ops' annotations
    dist.barrier()
    if dist.get_rank() != 0:
        return [], None
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = str(out / f"trace_{t.name}.json.gz")
    prof.export_chrome_trace(path)
    ivs = intervals_from_chrome_trace(path) if cuda else intervals_from_records(*recorded)
    return ivs, path


def _recorded_step(t: Trainee, batches: list[torch.Tensor]) -> tuple[list[OpRecord], float,
                                                                       float]:
    """One step with the schedule's tracer on: its records, start and end (host s)."""
    t.tracer.take()
    t.tracer.enabled = True
    t0 = time.perf_counter()
    t.step(batches)
    t1 = time.perf_counter()
    t.tracer.enabled = False
    return t.tracer.take(), t0, t1


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on rank 0 in a terminal (rich, when importable)."""
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        yield lambda _what: None
        return
    console = Console()
    off = dist.get_rank() != 0 or not console.is_terminal
    with Progress(console=console, transient=True, disable=off) as bar:
        task = bar.add_task("bench step", total=total)
        yield lambda what: bar.update(task, advance=1, description=what)


# --------------------------------------------------------------------------- results


def _results(cfg: Config, device: torch.device, trainees: list[Trainee],
             traces: dict[str, tuple[list[Interval], str | None]]) -> dict:
    """Slowest rank per step and largest peak over ranks; metrics from rank 0's trace."""
    cuda = device.type == "cuda"
    worst = torch.tensor([t.samples_ms for t in trainees], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    peaks = torch.tensor([t.peak_bytes for t in trainees], dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    schedules = {}
    for t, samples, peak in zip(trainees, worst.tolist(), peaks.tolist(), strict=True):
        median = statistics.median(samples)
        intervals, trace_path = traces[t.name]
        entry = {
            "strategy": SCHEDULES[t.name][0] if t.is_hsdp else "fsdp2",
            "overlap_outer": SCHEDULES[t.name][1] if t.is_hsdp else None,
            "t_step_ms": median, "t_step_min_ms": min(samples), "t_step_max_ms": max(samples),
            "t_step_samples_ms": samples,
            "tokens_per_s": cfg.global_tokens / (median * 1e-3),
            "peak_mem_bytes": int(peak) if cuda else None,
            "resident_mem_bytes": t.resident_bytes if cuda else None,
            "calibration_error": t.calibration_error,
            "trace": trace_path,
        }
        entry.update(_trace_metrics(intervals))
        schedules[t.name] = entry
    return {"meta": _meta(cfg, device, trainees), "schedules": schedules,
            "summary": _summary(schedules),
            "intervals": {name: traces[name][0] for name in schedules}}


def _trace_metrics(intervals: list[Interval]) -> dict:
    """step_metrics of the traced step, lower bound included (module docstring)."""
    keys = ("exposed_comm_ms", "outer_tail_ms", "comm_comm_overlap_ms", "lower_bound_ms",
            "tail_floor_ms")
    if not intervals:
        return dict.fromkeys((*keys, "metrics"))
    m = step_metrics(intervals)
    return {**{k: m[k] for k in keys}, "metrics": m}


def _summary(schedules: dict[str, dict]) -> dict:
    out = {}
    for fast, slow in PAIRS:
        if fast in schedules and slow in schedules:
            a, b = schedules[fast]["t_step_ms"], schedules[slow]["t_step_ms"]
            out[f"{fast}_vs_{slow}"] = {"saving_ms": b - a, "saving_pct": 100.0 * (b - a) / b}
    return out


def _meta(cfg: Config, device: torch.device, trainees: list[Trainee]) -> dict:
    cuda = device.type == "cuda"
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": {"host": platform.node(), "platform": platform.platform(),
                     "cpu_count": os.cpu_count(), "device": device.type,
                     "gpu": torch.cuda.get_device_name(device) if cuda else None,
                     "gpus": torch.cuda.device_count() if cuda else 0},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": None,
        "backend": str(dist.get_backend()),
        "mesh": {"outer": cfg.outer, "inner": cfg.inner, "world": cfg.world},
        "emulate": cfg.emulate,
        "fabric": None,
        "calibration_error": {t.name: t.calibration_error for t in trainees},
        "model": {**asdict(cfg.model), "mbs": cfg.mbs, "microbatches": cfg.microbatches,
                  "dtype": cfg.dtype, "reduce_dtype": cfg.reduce_dtype},
        "num_params": cfg.model.num_params,
        "global_tokens_per_step": cfg.global_tokens,
        "steps": cfg.steps, "warmup": cfg.warmup,
        "timing": "wall clock per step between barriers, every stream idle at the end "
                  "(cuda synchronize on GPU); median/min/max over steps of the slowest rank",
        "env": {k: os.environ.get(k) for k in NCCL_ENV},
    }
    if cuda:
        nccl = torch.cuda.nccl.version()
        meta["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    if cfg.fabric is not None:
        meta["fabric"] = {**asdict(cfg.fabric), "source": cfg.fabric_source}
    return meta


def _report(result: dict, cfg: Config) -> None:
    """Print the table; write the JSON and the timeline PNG."""
    intervals = result.pop("intervals")
    if any(intervals.values()):
        png = plot_timeline({k: v for k, v in intervals.items() if v},
                            Path(cfg.out_dir) / "timeline.png")
        result["meta"]["timeline"] = str(png)
    print_table(result)
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(result, f, indent=2)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def print_table(result: dict) -> None:
    """The summary table (``rich`` when importable), the lower bound and the savings."""
    m = result["meta"]
    mesh = m["mesh"]
    title = (f"bench step: mesh {mesh['outer']}x{mesh['inner']} (outer x inner)"
             f"{' emulated' if m['emulate'] else ''}, {m['num_params'] / 1e6:.1f} M params, "
             f"{m['model']['dtype']}, {m['global_tokens_per_step']} tokens/step, "
             f"median of {m['steps']} [min-max], slowest rank")
    headers = ["schedule", "t_step ms", "tokens/s", "peak mem GiB", "exposed comm ms",
               "outer tail ms", "comm-comm overlap ms", "lower bound ms"]
    cells = []
    for name, s in result["schedules"].items():
        peak = "-" if s["peak_mem_bytes"] is None else f"{s['peak_mem_bytes'] / GIB:.2f}"
        cells.append([name, f"{s['t_step_ms']:.2f} [{s['t_step_min_ms']:.2f}-"
                            f"{s['t_step_max_ms']:.2f}]", f"{s['tokens_per_s']:,.0f}", peak,
                      _ms(s["exposed_comm_ms"]), _ms(s["outer_tail_ms"]),
                      _ms(s["comm_comm_overlap_ms"]), _ms(s["lower_bound_ms"])])
    notes = ["lower bound = max(compute + tail, inner, outer): busy ms in one traced step "
             "(tail: its last outer reduction); exposed / tail / overlap: same step"]
    for pair, v in result["summary"].items():
        fast, slow = pair.split("_vs_")
        notes.append(f"{fast} vs {slow}: saves {v['saving_ms']:.2f} ms per step "
                     f"({v['saving_pct']:.1f}%)")
    if m["emulate"] and m["fabric"]:
        f = m["fabric"]
        errs = {k: v for k, v in m["calibration_error"].items() if v is not None}
        notes.append(f"fabric ({f['source']}): inner {f['inner']['bus_gbps']:.1f} GB/s, "
                     f"outer {f['outer']['bus_gbps']:.1f} GB/s, latency "
                     f"{f['inner']['latency_us']:.0f} us"
                     + (f"; sleep calibration error {max(map(abs, errs.values())):.2%}"
                        if errs else ""))
    print_rows(title, headers, cells, notes)
