"""Step bench: training step time and memory of hsdp's schedules and its peers on one model.

Schedules: see ``hsdp.bench.trainee`` (hsdp overlap / serial, hfsdp, torch FSDP2,
Megatron-FSDP).

Phases (one progress line each on rank 0):

1. build every schedule's model (its resident memory is measured one at a time);
2. ``--warmup`` untimed steps per schedule, one schedule at a time;
3. timing: the schedules take turns, one step each (A B C A B C ...), ``--steps`` times. A
   step (all microbatches, ``optimizer.step()``, clearing the gradients) is timed on the
   wall clock from a barrier to the point where every stream of its schedule is idle
   (hsdp's side streams drained, ``torch.cuda.synchronize`` on GPU) and a barrier; the
   slowest rank counts. hfsdp's outer all-gather after the optimizer step therefore counts
   in full: interleaving leaves it nothing to overlap. Host time: from the start of the step
   until the host has issued all of it (the optimizer step and clearing of gradients
   returned), before it waits for the device; on GPU, a host time close to the step time
   means the step is host-bound. tokens/s = global tokens per step / median step time;
4. memory per phase (GPU): one more step per schedule with the peak of each phase
   (forward, backward, optimizer: ``torch.cuda.max_memory_allocated`` between phase ends)
   less what the other schedules' models hold, so each figure is what the schedule would
   need alone; the peak over the timed steps is reported the same way;
5. recorded: ``--record-steps`` more interleaved steps per schedule without the profiler,
   with the schedule's tracer on (outside the timed steps: the tracer costs host time).
   Each hsdp schedule keeps, per step, its host marks (phase marks and side-op submits,
   ``hsdp.bench.trace.host_marks``) and, on GPU, each side op's time on its stream
   (timing events, ``Tracer.side_ms``): the simulator's calibration combines them over the
   steps (``hsdp.sim.calibrate``); on GPU also when the compute stream reached each phase
   mark (``Tracer.device_marks``: how far the device ran behind the host). CPU: the first
   step's stream records also give the traced step's intervals (the profiler's per-op
   cost is large next to small CPU ops);
6. collective-free (``--emulate`` only): ``--steps`` more interleaved steps with the
   emulated delays off, so collectives take no time at all (torch's fake process group
   launches nothing), next to the ``unsharded`` reference: the same layers unsharded plus
   AdamW over one rank's shard (``hsdp.bench.trainee``). Their ratio is the overhead of the
   sharding machinery itself;
7. trace: ``--trace-steps`` more interleaved steps per schedule, each under its own
   ``torch.profiler`` session, with the schedule's tracer on (hsdp's root unit tracer; the
   peers' collectives are intercepted, see ``hsdp.bench.intercept``). Rank 0 writes the
   Chrome traces to ``--out-dir``: ``trace_<schedule>.json.gz`` for the first profiled
   step, ``trace_<schedule>.<k>.json.gz`` for the k-th (k = 2..N; the JSON's ``traces``
   lists them all, ``trace`` names the first). The first step's intervals (GPU: from its
   Chrome trace; CPU: from the recorded step) give the metrics
   (``hsdp.report.metrics.step_metrics``) and one timeline PNG; the further traces are
   for the calibration (a kernel slowed down, e.g. beside NCCL kernels waiting for a
   peer, is only ever slower: it takes the least device time per phase).

Lower bound: ``max(compute + tail, inner, outer)`` from each schedule's traced step,
with compute / inner / outer the busy time of each resource and tail the duration of
the last outer reduction (it cannot start before the last backward kernel ends; the
floor of ``outer_tail``, docs/design.md "What is measured"). The tail is attached to the
compute chain it must follow, which keeps it a true bound when communication dominates.

Comparisons (``hsdp.report.compare``): overlapped vs serialized, and each hsdp schedule vs
each peer: no verdict under 5 timed steps, "within noise" when the two schedules' min-max
step-time ranges overlap, each one's spread otherwise; on CPU labelled as schedule checks.

``--tp N``: tensor parallelism inside each data-parallel rank, on a 3-D (outer, inner, tp)
mesh (``hsdp.init_mesh(..., tp=N)``, tp fastest): every schedule's Llama gets torch's TP
plan on ``mesh["tp"]`` (``hsdp.bench.tp_plan``), FSDP2 shards on ``mesh["outer", "inner"]``; a
TP group shares its tokens (global tokens count the outer x inner data-parallel ranks).
The TP collectives run where torch issues them, on the compute stream; under
``--emulate`` they are delayed there by their modelled time on the ``--tp-gbps`` link.

``--emulate``: one process posing as rank 0 of the mesh (torch's fake process group);
every collective first waits its modelled duration (``hsdp.sim.fabric.Fabric``) on its own
stream: ``torch.cuda._sleep`` on GPU (calibrated; the error is reported), host sleeps on
hsdp's stream threads on CPU. ``--fabric-json`` fits the fabric to a ``bench
collectives`` JSON (see ``fabric_from_collectives``). ``--share-gpus``: several ranks per
GPU (``hsdp.bench.launch``), for correctness only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import hsdp
from hsdp.bench.collectives import DTYPES, default_mesh
from hsdp.bench.emulate import fake_mesh
from hsdp.bench.launch import (
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
from hsdp.bench.mfsdp import PeerUnavailable, import_mfsdp
from hsdp.bench.trace import host_marks, intervals_from_chrome_trace, intervals_from_records
from hsdp.bench.trainee import (
    PEERS,
    PHASES,
    SCHEDULES,
    Trainee,
    build,
    build_unsharded,
    synthetic_batches,
)
from hsdp.float8 import INSTALL as FLOAT8_INSTALL
from hsdp.models import CHECKPOINT_MODES, GPTConfig, LlamaConfig, ModelConfig
from hsdp.report.args import parse_mesh
from hsdp.report.compare import CPU_NOTE, compare, describe
from hsdp.report.metrics import Interval, step_metrics
from hsdp.report.table import print_table as print_rows
from hsdp.report.timeline import plot_timeline
from hsdp.sharding.policy import parse_outer_reduce as as_outer_reduce_text
from hsdp.sim.fabric import Fabric, Link, fit_link
from hsdp.streams.contract import OpRecord

# (overlapped, serialized) pairs whose saving is reported
PAIRS = (("overlap", "serial"), ("hfsdp", "hfsdp-serial"))
# Model when not given (hsdp.models). GPU: 8 Llama-8B layers (SwiGLU, grouped-query
# attention, RMSNorm), what users run, with enough compute per layer that an H200 is not
# waiting on the host; CPU: the same architecture, quick.
MODEL_DEFAULTS = {
    "cuda": {"arch": "llama", "layers": 8, "hidden": 4096, "heads": 32, "kv_heads": 8,
             "ffn": 14336, "vocab": 32768, "seq": 2048, "mbs": 1},
    "cpu": {"arch": "llama", "layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2,
            "ffn": 384, "vocab": 1024, "seq": 128, "mbs": 2},
}
ARCHS = {"llama": LlamaConfig, "gpt": GPTConfig}
MODEL_SIZES = (("layers", "transformer blocks"), ("hidden", "hidden size"),
               ("heads", "attention heads"), ("kv_heads", "key/value heads (llama)"),
               ("ffn", "MLP size"), ("vocab", "vocabulary size"), ("seq", "sequence length"),
               ("mbs", "micro-batch size (sequences per rank)"))
EMULATED_MESH = {"cuda": (16, 8), "cpu": (2, 4)}  # --emulate without --mesh
GIB = 1 << 30


# --------------------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser,
                  model_defaults: dict[str, dict[str, int]] = MODEL_DEFAULTS) -> None:
    """The options; ``model_defaults`` (per device type) fill the model sizes not given."""
    p.set_defaults(model_defaults=model_defaults)
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to spawn (default: all GPUs, twice that with "
                        "--share-gpus, or 4 on CPU); ignored under torchrun and with "
                        "--emulate")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: gloo ranks even where GPUs exist (default: cuda when present)")
    p.add_argument("--mesh", type=parse_mesh, default=None,
                   help="OUTERxINNER (default: 2 x world/2; with --emulate 16x8 on GPU, "
                        "2x4 on CPU)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per data-parallel rank (llama only): a 3-D "
                        "OUTERxINNERxTP mesh, torch's TP plan on its 'tp' dim (default 1)")
    add_layout_argument(p)
    model = p.add_argument_group("model (hsdp.models; defaults: GPU / CPU)")
    d = f"{model_defaults['cuda']['arch']} / {model_defaults['cpu']['arch']}"
    model.add_argument("--arch", choices=sorted(ARCHS), default=None,
                       help=f"llama: RMSNorm, grouped-query attention, SwiGLU; gpt: "
                            f"LayerNorm, GELU MLP ({d})")
    for name, help_ in MODEL_SIZES:
        d = f"{model_defaults['cuda'][name]} / {model_defaults['cpu'][name]}"
        model.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                           help=f"{help_} ({d})")
    model.add_argument("--checkpoint", choices=CHECKPOINT_MODES, default="none",
                       help="activation checkpointing (see hsdp.models)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="microbatches per step (outer reduction on the last only)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="parameter dtype for compute (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--float8", action="store_true",
                   help="torchao float8 linears (tensorwise, float8 all-gather on) in every "
                        "schedule; emulated matmuls on CPU (needs hsdp[float8])")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32",
                   help="gradient reduction dtype")
    p.add_argument("--schedules", type=parse_schedules, default=parse_schedules(
        "overlap,serial,fsdp2"), help=f"comma-separated among {', '.join(SCHEDULES)} "
                                      f"(default: overlap,serial,fsdp2)")
    p.add_argument("--outer-reduce", type=parse_outer_reduce, default=None,
                   metavar="DTYPE[:BLOCK]", help="the compressed outer reduction of the "
                   "schedules overlap-q and hfsdp-q: int8 or fp8_e4m3, block 256 unless "
                   "given (default: int8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per schedule first")
    p.add_argument("--record-steps", type=int, default=3,
                   help="untimed steps per schedule with its tracer on, without the "
                        "profiler: host marks and side-op stream times of each, for "
                        "`hsdp sim` calibration (default 3)")
    p.add_argument("--trace-steps", type=int, default=2,
                   help="profiled steps per schedule, one Chrome trace each; the first "
                        "gives the metrics and the timeline (default 2)")
    emu = p.add_argument_group("emulation")
    emu.add_argument("--emulate", action="store_true",
                     help="one process posing as the whole mesh, modelled collective times")
    emu.add_argument("--inner-gbps", type=float, default=370.0, help="inner bus GB/s")
    emu.add_argument("--outer-gbps", type=float, default=47.0, help="outer bus GB/s")
    emu.add_argument("--tp-gbps", type=float, default=370.0,
                     help="tp bus GB/s (TP collectives, with --tp)")
    emu.add_argument("--latency-us", type=float, default=20.0,
                     help="per collective, us (with --fabric-json: where it cannot be fitted)")
    emu.add_argument("--fabric-json", default=None, metavar="PATH",
                     help="fit inner/outer latency and bandwidth to a `bench collectives` "
                          "JSON instead (an axis of one rank keeps the flags' link)")
    p.add_argument("--json", default=None, metavar="PATH", help="write results here")
    p.add_argument("--out-dir", default="out/bench_step",
                   help="Chrome traces and timeline.png (default: ./out/bench_step)")


def parse_outer_reduce(text: str) -> hsdp.OuterReduce | None:
    """``--outer-reduce``: "int8", "fp8_e4m3:128"."""
    try:
        return as_outer_reduce_text(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def parse_schedules(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [n for n in names if n not in SCHEDULES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"bad --schedules {text!r}: expected distinct names among {', '.join(SCHEDULES)}")
    return names


def fabric_from_collectives(path: str | Path, default: Fabric) -> tuple[Fabric, dict]:
    """A ``Fabric`` fitted to every size of a ``bench collectives`` JSON.

    Inner: the reduce-scatter ``t_rs_ms`` of ``size_bytes`` (its input) over the inner
    group; outer: the all-reduce ``t_ar_ms`` of ``size_bytes / inner`` (the RS output) over
    the outer group; each fitted by ``hsdp.sim.fabric.fit_link`` (latency and bus bandwidth;
    ``default``'s latency where only the bandwidth can be fitted). An axis of one rank was
    not measured and runs no collective: it keeps ``default``'s link. Returns the fabric
    and, per axis, the fit's largest relative error over the sizes (None: not fitted).
    """
    data = json.loads(Path(path).read_text())
    inner, outer = data["meta"]["inner"], data["meta"]["outer"]
    links, errors = {}, {}
    for axis, kind, n, key, div in (("inner", "reduce_scatter", inner, "t_rs_ms", 1),
                                    ("outer", "all_reduce", outer, "t_ar_ms", inner)):
        links[axis], errors[axis] = getattr(default, axis), None
        if n < 2:
            continue
        samples = [(r["size_bytes"] // div, r[key] * 1e-3) for r in data["rows"]]
        try:
            link = fit_link(kind, n, samples, links[axis].latency_us)
        except ValueError as e:
            raise SystemExit(f"hsdp bench step: {path}: {axis}: {e}") from None
        model = Fabric(link, link)
        links[axis] = link
        errors[axis] = max(abs(model.seconds(kind, "inner", b, n) - t) / t for b, t in samples)
    if all(e is None for e in errors.values()):
        raise SystemExit(f"hsdp bench step: {path}: mesh {outer}x{inner} has no group of "
                         f"two or more ranks to fit a link on")
    return Fabric(links["inner"], links["outer"]), errors


@dataclass(frozen=True)
class Config:
    """Resolved arguments, identical on every rank."""

    world: int
    outer: int
    inner: int
    model: ModelConfig
    mbs: int
    microbatches: int
    dtype: str
    reduce_dtype: str
    schedules: tuple[str, ...]
    steps: int
    warmup: int
    record_steps: int
    trace_steps: int
    emulate: bool
    fabric: Fabric | None
    fabric_source: str | None
    json_path: str | None
    out_dir: str
    cuda: bool
    share_gpus: bool = False
    fabric_fit: dict | None = None  # per axis: the fit's largest relative error
    float8: bool = False  # torchao float8 linears (--float8)
    tp: int = 1  # tensor-parallel ranks (--tp): world = outer * inner * tp
    tp_fabric: Fabric | None = None  # emulated TP collectives (its inner link: --tp-gbps)
    outer_reduce: hsdp.OuterReduce | None = None  # the "-q" schedules' (--outer-reduce)

    @property
    def global_tokens(self) -> int:
        """A TP group's ranks share their tokens."""
        return self.outer * self.inner * self.mbs * self.model.seq * self.microbatches

    @property
    def mp(self) -> hsdp.MixedPrecision:
        return hsdp.MixedPrecision(DTYPES[self.dtype], DTYPES[self.reduce_dtype])

    def describe(self) -> str:
        m = self.model
        kv = f" ({m.kv_heads} kv)" if isinstance(m, LlamaConfig) else ""
        return (f"{m.arch} {m.layers} layers, hidden {m.hidden}, ffn {m.ffn}, heads "
                f"{m.heads}{kv}, vocab {m.vocab}, seq {m.seq}, mbs {self.mbs}, {self.dtype}"
                f"{' + float8' if self.float8 else ''}: {m.num_params / 1e6:.1f} M params")


def resolve(args: argparse.Namespace, cuda: bool, world: int | None) -> Config:
    """Fill defaults that depend on the device and world; check the rest. ``world`` is
    None with ``--emulate`` (the mesh decides it)."""
    def fail(msg: str) -> SystemExit:
        return SystemExit(f"hsdp bench step: {msg}")

    device = "cuda" if cuda else "cpu"
    tp = args.tp
    if tp < 1:
        raise fail(f"--tp must be at least 1, got {tp}")
    if world is None:
        outer, inner = args.mesh or EMULATED_MESH[device]
        world = outer * inner * tp
    else:
        if world < 1:
            raise fail(f"need at least one rank, got {world}")
        if world % tp:
            raise fail(f"--tp {tp} does not divide the job's {world} ranks; pick --nproc "
                       f"a multiple of {tp}")
        outer, inner = args.mesh or default_mesh(world // tp)
        if outer * inner * tp != world:
            with_tp, times_tp = (f" with --tp {tp}", "*TP") if tp > 1 else ("", "")
            raise fail(f"mesh {outer}x{inner}{with_tp} has {outer * inner * tp} ranks but the "
                       f"job has {world}; pick --mesh OUTERxINNER with OUTER*INNER{times_tp} = "
                       f"{world} (or --nproc {outer * inner * tp})")
    share = bool(args.share_gpus) and cuda and not args.emulate
    if share:
        check_shared_layout("bench step", outer, inner, torch.cuda.device_count())
    if min(args.steps, args.warmup, args.record_steps, args.trace_steps,
           args.microbatches) < 1:
        raise fail("need --steps >= 1, --warmup >= 1 (the first step records the unit "
                   "order and creates optimizer state), --record-steps >= 1, "
                   "--trace-steps >= 1 and --microbatches >= 1")
    if args.float8:
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise fail(f"--float8 needs torchao: {FLOAT8_INSTALL}") from None
    if args.float8 and "mfsdp" in args.schedules:
        raise fail("--float8: schedule 'mfsdp' is not converted; leave it out")
    if tp > 1:
        _check_tp(args, fail)
    if "mfsdp" in args.schedules:
        try:
            import_mfsdp()
        except PeerUnavailable as e:
            raise fail(str(e)) from None
        if not cuda:
            raise fail("schedule 'mfsdp': Megatron-FSDP runs on CUDA only")
    sizes = {k: getattr(args, k) if getattr(args, k, None) is not None else v
             for k, v in args.model_defaults[device].items()}
    mbs, arch = sizes.pop("mbs"), sizes.pop("arch")
    if arch == "gpt":
        if args.kv_heads is not None:
            raise fail("--kv-heads applies to --arch llama only")
        sizes.pop("kv_heads", None)
    try:
        model = ARCHS[arch](checkpoint=args.checkpoint, **sizes)
    except ValueError as e:
        raise fail(str(e)) from None
    fabric, source, fit, tp_fabric = None, None, None, None
    if args.emulate:
        fabric = Fabric(Link(args.inner_gbps, args.latency_us),
                        Link(args.outer_gbps, args.latency_us))
        source = "flags"
        if tp > 1:
            tp_link = Link(args.tp_gbps, args.latency_us)
            tp_fabric = Fabric(tp_link, tp_link)
    if args.emulate and args.fabric_json:
        fabric, fit = fabric_from_collectives(args.fabric_json, fabric)
        source = args.fabric_json
    return Config(world, outer, inner, model, mbs, args.microbatches,
                  args.dtype or ("bf16" if cuda else "fp32"), args.reduce_dtype,
                  tuple(args.schedules), args.steps, args.warmup, args.record_steps,
                  args.trace_steps, args.emulate, fabric,
                  source, args.json, args.out_dir, cuda, share, fit, args.float8, tp,
                  tp_fabric, args.outer_reduce)


def _check_tp(args: argparse.Namespace, fail: Callable[[str], SystemExit]) -> None:
    """What ``--tp`` > 1 does not run, refused before any rank starts."""
    if (args.arch or args.model_defaults["cpu"]["arch"]) != "llama":
        raise fail("--tp: the TP plan is for --arch llama only")
    if args.float8:
        raise fail("--tp with --float8: torchao's float8 TP styles are not wired in; leave "
                   "one out")
    if "mfsdp" in args.schedules:
        raise fail("--tp: schedule 'mfsdp' has no TP plan here; leave it out")
    if args.share_gpus:
        raise fail("--tp with --share-gpus is not supported; give each rank its own GPU")


# --------------------------------------------------------------------------- launch


def run(args: argparse.Namespace) -> int:
    """Entry point: one emulating process, in place under torchrun, or spawned ranks."""
    cuda = select_cuda(args.device, "bench step")
    if args.emulate:
        cfg = resolve(args, cuda, None)
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        mesh = fake_mesh(cfg.outer, cfg.inner, device.type, cfg.tp)
        try:
            _report(bench(cfg, device, mesh), cfg)
        finally:
            dist.destroy_process_group()
        return 0
    return launch("bench step", _worker, lambda world: resolve(args, cuda, world), args.nproc,
                  cuda, bool(args.share_gpus))


def _worker(local_rank: int, cfg: Config, port: int | None) -> None:
    with rank_process_group(local_rank, cfg.world, port, cfg.cuda,
                            cfg.inner if cfg.share_gpus else None) as device:
        mesh = hsdp.init_mesh(cfg.outer, cfg.inner, device.type, tp=cfg.tp)
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


# --------------------------------------------------------------------------- bench


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _warm_libraries(device: torch.device) -> None:
    """Make the device's one-time allocations (cuBLAS workspaces of the main and the
    autograd thread, tens of MiB on an H200) before any schedule's memory is counted:
    they would count against whichever schedule ran first."""
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        (x @ x).sum().backward()
    torch.cuda.synchronize(device)


class _Progress:
    """One line per phase on rank 0 (stderr), with the phase's wall time."""

    def __init__(self) -> None:
        self.on = dist.get_rank() == 0
        self.t0 = time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        if self.on:
            print(f"bench step: {what} ({now - self.t0:.1f} s)", file=sys.stderr, flush=True)
        self.t0 = now


def bench(cfg: Config, device: torch.device, mesh: DeviceMesh) -> dict:
    """Every phase of the module docstring; the result dict on rank 0 (partial on the
    others)."""
    cuda = device.type == "cuda"
    batches = synthetic_batches(cfg.model.vocab, cfg.mbs, cfg.model.seq, cfg.microbatches,
                                device, cfg.tp)
    progress = _Progress()
    if cuda:
        _warm_libraries(device)
    trainees = []
    for name in cfg.schedules:
        with _oom_guard(name, cfg):
            before = _allocated(device)
            trainees.append(build(name, cfg.model, cfg.mp, mesh, device, cfg.fabric,
                                  cfg.emulate, cfg.float8, cfg.tp_fabric, cfg.outer_reduce))
            trainees[-1].resident_bytes = _allocated(device) - before
        progress(f"built {name}")
    for t in trainees:
        with _oom_guard(t.name, cfg):
            before = _allocated(device)
            for _ in range(cfg.warmup):
                t.step(batches)
            t.resident_bytes += _allocated(device) - before
    progress(f"warm-up: {cfg.warmup} steps of each schedule")
    for _ in range(cfg.steps):
        for t in trainees:  # interleaved: A B C A B C ...
            with _oom_guard(t.name, cfg):
                _timed_step(t, batches, device)
    progress(f"timed: {cfg.steps} interleaved steps of each schedule")
    if cuda:
        for t in trainees:
            with _oom_guard(t.name, cfg):
                _phase_memory(t, batches, device)
        progress("memory per phase: one step of each schedule")
    cpu_records = _record(cfg, trainees, batches, cuda)
    progress(f"recorded: {cfg.record_steps} interleaved steps of each "
             f"{'hsdp ' if cuda else ''}schedule, tracer on")
    reference = None
    if cfg.emulate:
        reference = _collective_free(cfg, trainees, batches, device, mesh)
        progress(f"collective-free: {cfg.steps} interleaved steps of each schedule and of "
                 f"the unsharded reference")
    paths: dict[str, list[str]] = {t.name: [] for t in trainees}
    for k in range(1, cfg.trace_steps + 1):
        for t in trainees:
            with _oom_guard(t.name, cfg):
                path = _trace(t, batches, cfg, k, cuda)
            if path is not None:
                paths[t.name].append(path)
    traces = {name: (_intervals(p[0], cpu_records.get(name)) if p else [], p)
              for name, p in paths.items()}
    progress(f"traced: {cfg.trace_steps} profiled steps of each schedule")
    return _results(cfg, device, trainees, traces, reference)


def _record(cfg: Config, trainees: list[Trainee], batches: list[torch.Tensor],
            cuda: bool) -> dict[str, tuple[list[OpRecord], float, float]]:
    """The recorded steps (module docstring): each hsdp trainee's host marks and side-op
    stream times per step; returns, on CPU, each schedule's first recorded step (records,
    start, end) for its intervals."""
    first = {}
    for _ in range(cfg.record_steps):
        for t in trainees:
            hsdp_schedule = SCHEDULES[t.name].library == "hsdp"
            if cuda and not hsdp_schedule:
                continue
            with _oom_guard(t.name, cfg):
                host_barrier()
                records, t0, t1 = _recorded_step(t, batches)
            if hsdp_schedule:
                t.host_marks.append(host_marks(records, t0))
                t.side_ms.append(t.tracer.side_ms())
                t.device_marks.append(t.tracer.device_marks())
            if not cuda:
                first.setdefault(t.name, (records, t0, t1))
    return first


def _timed_step(t: Trainee, batches: list[torch.Tensor], device: torch.device) -> None:
    cuda = device.type == "cuda"
    host_barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    others = _allocated(device) - t.resident_bytes  # held by the other schedules' models
    retries = allocator_retries(device)
    t0 = time.perf_counter()
    host = t.step(batches)
    host_barrier()
    t.samples_ms.append((time.perf_counter() - t0) * 1e3)
    t.host_ms.append(host * 1e3)
    if cuda:
        t.peak_bytes = max(t.peak_bytes, torch.cuda.max_memory_allocated(device) - others)
        t.alloc_retries.append(allocator_retries(device) - retries)


def allocator_retries(device: torch.device) -> int:
    """How often the caching allocator has failed an allocation, freed its cache and
    tried again: each time it synchronizes the device and stalls the host, so a timed step
    with one measures memory pressure (e.g. from the other schedules' models beside it)
    rather than its schedule. 0 off CUDA (as ``_allocated``)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def _phase_memory(t: Trainee, batches: list[torch.Tensor], device: torch.device) -> None:
    """Peak memory of each phase of one step, less what the other models hold."""
    host_barrier()
    others = _allocated(device) - t.resident_bytes
    peaks = dict.fromkeys(PHASES, 0)
    torch.cuda.reset_peak_memory_stats(device)

    def mark(phase: str) -> None:
        peaks[phase] = max(peaks[phase], torch.cuda.max_memory_allocated(device) - others)
        torch.cuda.reset_peak_memory_stats(device)

    t.step(batches, mark=mark)
    t.phase_peak_bytes = peaks


def _collective_free(cfg: Config, trainees: list[Trainee], batches: list[torch.Tensor],
                     device: torch.device, mesh: DeviceMesh) -> Trainee:
    """Interleaved steps without emulated delays, and the unsharded reference's steps."""
    with _oom_guard("unsharded", cfg):
        ref = build_unsharded(cfg.model, cfg.mp, cfg.inner, device, cfg.float8,
                              mesh["tp"] if cfg.tp > 1 else None)
        for _ in range(cfg.warmup):
            ref.step(batches)
    for _ in range(cfg.steps):
        for t in [*trainees, ref]:
            with _oom_guard(t.name, cfg):
                t0 = time.perf_counter()
                host = t.step(batches, delays=False)
                t.free_ms.append((time.perf_counter() - t0) * 1e3)
                if t is ref:  # the schedules' host times come from the timed steps
                    t.host_ms.append(host * 1e3)
    ref.model = None  # its memory goes back before the traces
    return ref


def _trace(t: Trainee, batches: list[torch.Tensor], cfg: Config, k: int,
           cuda: bool) -> str | None:
    """Profile one step, the schedule's ``k``-th profiled one; rank 0 returns the path of
    its Chrome trace (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    host_barrier()
    prof = profile(activities=activities, acc_events=True)  # no warning about cycles
    with _without_kineto_log():
        prof.__enter__()
    try:
        _recorded_step(t, batches)  # on CUDA, the tracer adds the ops' annotations
    finally:
        with _without_kineto_log():
            prof.__exit__(None, None, None)
    host_barrier()
    if dist.get_rank() != 0:
        return None
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = str(out / f"trace_{t.name}{f'.{k}' if k > 1 else ''}.json.gz")
    prof.export_chrome_trace(path)
    return path


def _intervals(trace: str, recorded: tuple[list[OpRecord], float, float] | None
               ) -> list[Interval]:
    """The first profiled step's intervals: from its Chrome trace (GPU), else from the
    CPU stream records ``recorded`` (records, start, end) of the first recorded step."""
    if recorded is None:
        return intervals_from_chrome_trace(trace)
    return intervals_from_records(*recorded)


# Kineto's own log lines ("USDT:... profiler_start"), one per profiler start and stop
KINETO_LINE = re.compile(r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


@contextmanager
def _without_kineto_log() -> Iterator[None]:
    """Drop Kineto's log lines, which it writes to file descriptor 2 when the profiler
    starts and stops; anything else written meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(True)
                    if not KINETO_LINE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _recorded_step(t: Trainee, batches: list[torch.Tensor]) -> tuple[list[OpRecord], float,
                                                                       float]:
    """One step with the schedule's tracer on: its records, start and end (host s)."""
    t.tracer.clear()
    t.tracer.enabled = True
    t0 = time.perf_counter()
    t.step(batches)
    t1 = time.perf_counter()
    t.tracer.enabled = False
    return t.tracer.take(), t0, t1


# --------------------------------------------------------------------------- results


def _worst(rows: list[list[float]], device: torch.device) -> list[list[float]]:
    """Element-wise maximum over ranks of equally shaped rows (slowest rank, largest
    peak)."""
    if not rows or not rows[0]:
        return rows
    t = torch.tensor(rows, dtype=torch.float64, device=bookkeeping_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _other_ranks(trainees: list[Trainee]) -> list[list[dict]]:
    """Per trainee, what ranks 1.. measured of their own (rank 0's is the entry itself):
    host time per timed step, and the recorded steps' host marks, side-op stream times
    and device marks. The simulator runs the ranks together from them (a rank behind on
    the host holds up the collectives of the others). Not under ``--emulate``: one
    process."""
    mine = [{"t_host_samples_ms": t.host_ms, "host_marks_steps": t.host_marks or None,
             "side_ms_steps": t.side_ms or None, "device_marks_steps": _device_marks(t)}
            for t in trainees]
    everyone: list[list[dict] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [[rank[i] for rank in everyone[1:]] for i in range(len(trainees))]


def _device_marks(t: Trainee) -> list[list[list]] | None:
    """The recorded steps' device marks (``Tracer.device_marks``; None off CUDA)."""
    return t.device_marks if any(t.device_marks) else None


def _spread(samples: list[float], key: str) -> dict:
    """``{key}_ms``: median, ``{key}_min_ms``, ``{key}_max_ms`` (None when not measured)."""
    if not samples:
        return dict.fromkeys((f"{key}_ms", f"{key}_min_ms", f"{key}_max_ms"))
    return {f"{key}_ms": statistics.median(samples), f"{key}_min_ms": min(samples),
            f"{key}_max_ms": max(samples)}


def _results(cfg: Config, device: torch.device, trainees: list[Trainee],
             traces: dict[str, tuple[list[Interval], list[str]]],
             reference: Trainee | None) -> dict:
    """Slowest rank per step and largest peak over ranks; metrics from rank 0's trace."""
    cuda = device.type == "cuda"
    steps = _worst([t.samples_ms for t in trainees], device)
    hosts = _worst([t.host_ms for t in trainees], device)
    frees = _worst([t.free_ms for t in trainees], device)
    peaks = _worst([[t.peak_bytes, *(t.phase_peak_bytes.get(p, 0) for p in PHASES)]
                    for t in trainees], device)
    retries = _worst([t.alloc_retries for t in trainees], device) if cuda else None
    others = _other_ranks(trainees) if not cfg.emulate else [[] for _ in trainees]
    ref = None
    if reference is not None:
        ref_free, ref_host = _worst([reference.free_ms, reference.host_ms], device)
        ref = {"name": reference.name,
               "what": "the same layers unsharded in the parameter dtype, forward + "
                       "backward, plus AdamW over one rank's shard of every parameter "
                       "(fp32); no collectives",
               **_spread(ref_free, "t_step"), **_spread(ref_host, "t_host")}
    schedules = {}
    for i, t in enumerate(trainees):
        s = SCHEDULES[t.name]
        intervals, trace_paths = traces[t.name]
        entry = {
            "library": s.library, "strategy": s.strategy, "overlap_outer": s.overlap,
            **_spread(steps[i], "t_step"), "t_step_samples_ms": steps[i],
            **_spread(hosts[i], "t_host"), **_spread(frees[i] if frees else [], "t_free"),
            "tokens_per_s": cfg.global_tokens / (statistics.median(steps[i]) * 1e-3),
            "peak_mem_bytes": int(peaks[i][0]) if cuda else None,
            "peak_mem_phase_bytes": (dict(zip(PHASES, map(int, peaks[i][1:]), strict=True))
                                     if cuda else None),
            "resident_mem_bytes": t.resident_bytes if cuda else None,
            # timed steps in which some rank's allocator retried (see allocator_retries)
            "alloc_retry_steps": sum(n > 0 for n in retries[i]) if cuda else None,
            "calibration_error": t.calibration_error,
            "trace": trace_paths[0] if trace_paths else None,
            "traces": trace_paths,
            "host_marks_steps": t.host_marks or None,
            "side_ms_steps": t.side_ms or None,
            "device_marks_steps": _device_marks(t),
            "other_ranks": others[i],
            # this rank's, per step (every step issues the same collectives)
            "collective_bytes_per_step": {k: v // max(t.steps_run, 1)
                                          for k, v in sorted(t.collective_bytes.items())},
        }
        entry["free_over_unsharded"] = (entry["t_free_ms"] / ref["t_step_ms"]
                                        if ref and entry["t_free_ms"] else None)
        entry.update(_trace_metrics(intervals))
        schedules[t.name] = entry
    return {"meta": _meta(cfg, device, trainees), "schedules": schedules, "reference": ref,
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
    pairs = [*PAIRS, *((h, p) for h in ("overlap", "hfsdp") for p in PEERS)]
    return {f"{a}_vs_{b}": compare(schedules[a], schedules[b]) for a, b in pairs
            if a in schedules and b in schedules}


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
        "megatron_fsdp": (import_mfsdp().__version__ if "mfsdp" in cfg.schedules else None),
        "backend": str(dist.get_backend()),
        "mesh": {"outer": cfg.outer, "inner": cfg.inner, "tp": cfg.tp, "world": cfg.world},
        "layout": (SHARED_LAYOUT_NOTE if cfg.share_gpus else
                   "one process (fake process group)" if cfg.emulate else "one rank per GPU"
                   if cuda else "gloo ranks on CPU"),
        "emulate": cfg.emulate,
        "outer_reduce": asdict(cfg.outer_reduce or hsdp.OuterReduce()) if any(
            SCHEDULES[n].compressed for n in cfg.schedules) else None,
        "fabric": None,
        "calibration_error": {t.name: t.calibration_error for t in trainees},
        "model": {**asdict(cfg.model), "mbs": cfg.mbs, "microbatches": cfg.microbatches,
                  "dtype": cfg.dtype, "reduce_dtype": cfg.reduce_dtype},
        "num_params": cfg.model.num_params,
        "global_tokens_per_step": cfg.global_tokens,
        "steps": cfg.steps, "warmup": cfg.warmup, "record_steps": cfg.record_steps,
        "trace_steps": cfg.trace_steps,
        "timing": "wall clock per step between barriers, every stream idle at the end "
                  "(cuda synchronize on GPU); median/min/max over steps of the slowest rank; "
                  "host: until the step was issued; free: emulated delays off",
        "env": {k: os.environ.get(k) for k in RECORDED_ENV},
    }
    if cuda:
        nccl = torch.cuda.nccl.version()
        meta["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    if cfg.fabric is not None:
        meta["fabric"] = {**asdict(cfg.fabric), "source": cfg.fabric_source,
                          "fit_max_rel_err": cfg.fabric_fit}
        if cfg.tp_fabric is not None:
            meta["fabric"]["tp"] = asdict(cfg.tp_fabric.inner)
    return meta


def _report(result: dict, cfg: Config) -> None:
    """Print the table; write the JSON and the timeline PNG; say where they went."""
    intervals = result.pop("intervals")
    if any(intervals.values()):
        png = plot_timeline({k: v for k, v in intervals.items() if v},
                            Path(cfg.out_dir) / "timeline.png")
        result["meta"]["timeline"] = str(png)
    print_table(result)
    if cfg.json_path:
        Path(cfg.json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(cfg.json_path, "w") as f:
            json.dump(result, f, indent=2)
    where = [f"traces: {Path(cfg.out_dir) / 'trace_<schedule>.json.gz'}"
             + (f" (and trace_<schedule>.<k>.json.gz, k = "
                f"{'2' if cfg.trace_steps == 2 else f'2..{cfg.trace_steps}'})"
                if cfg.trace_steps > 1 else "")]
    if "timeline" in result["meta"]:
        where.append(f"timeline: {result['meta']['timeline']} (one traced step; the "
                     f"comparisons come from the timed steps)")
    if cfg.json_path:
        where.append(f"JSON: {cfg.json_path}")
    print("bench step: " + "; ".join(where), flush=True)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _gib(v: float | None) -> str:
    return "-" if v is None else f"{v / GIB:.2f}"


def print_table(result: dict) -> None:
    """The summary table (``rich`` when importable), the lower bound and comparisons."""
    m = result["meta"]
    mesh = m["mesh"]
    tp = mesh.get("tp", 1)
    title = (f"bench step: mesh {mesh['outer']}x{mesh['inner']}"
             + (f"x{tp} (outer x inner x tp)" if tp > 1 else " (outer x inner)") +
             f"{' emulated' if m['emulate'] else ''}, {m['num_params'] / 1e6:.1f} M params, "
             f"{m['model']['dtype']}, {m['global_tokens_per_step']} tokens/step, "
             f"median of {m['steps']} [min-max], slowest rank")
    if m["layout"] == SHARED_LAYOUT_NOTE:
        title += f" -- {SHARED_LAYOUT_NOTE}"
    headers = ["schedule", "t_step ms", "host ms", "free ms", "tokens/s", "peak GiB",
               "fwd / bwd / opt GiB", "exposed comm ms", "outer tail ms",
               "comm-comm overlap ms", "lower bound ms"]
    cells = []
    for name, s in result["schedules"].items():
        phases = s["peak_mem_phase_bytes"]
        cells.append([name, f"{s['t_step_ms']:.2f} [{s['t_step_min_ms']:.2f}-"
                            f"{s['t_step_max_ms']:.2f}]", _ms(s["t_host_ms"]),
                      _ms(s["t_free_ms"]), f"{s['tokens_per_s']:,.0f}",
                      _gib(s["peak_mem_bytes"]),
                      " / ".join(_gib(phases[p]) for p in PHASES) if phases else "-",
                      _ms(s["exposed_comm_ms"]), _ms(s["outer_tail_ms"]),
                      _ms(s["comm_comm_overlap_ms"]), _ms(s["lower_bound_ms"])])
    ref = result.get("reference")
    if ref:
        cells.append([f"{ref['name']} (reference)", "-", _ms(ref["t_host_ms"]),
                      _ms(ref["t_step_ms"]), *["-"] * 7])
    notes = ["lower bound = max(compute + tail, inner, outer): busy ms in one traced step "
             "(tail: its last outer reduction); exposed / tail / overlap: same step",
             "host: time to issue the step; peak: over the timed steps, and per phase in "
             "one more step, without the other schedules' models"]
    if ref:
        notes.append("free: collective-free step (emulated delays off); reference: "
                     + ref["what"] + "; free / reference: " + ", ".join(
                         f"{n} {s['free_over_unsharded']:.2f}x"
                         for n, s in result["schedules"].items() if s["free_over_unsharded"]))
    retried = {n: s["alloc_retry_steps"] for n, s in result["schedules"].items()
               if s.get("alloc_retry_steps")}
    if retried:
        notes.append("memory pressure: the caching allocator freed its cache and retried "
                     "(a device synchronization) in " + ", ".join(
                         f"{k} of {m['steps']} timed steps of {n}" for n, k in retried.items())
                     + "; those steps' times are the allocator's, not the schedule's (run "
                       "fewer schedules at once)")
    cpu = m["hardware"]["device"] == "cpu"
    notes.extend(describe(pair, v, cpu) for pair, v in result["summary"].items())
    if cpu:
        notes.append(CPU_NOTE)
    if m["emulate"] and m["fabric"]:
        f = m["fabric"]
        errs = {k: v for k, v in m["calibration_error"].items() if v is not None}
        notes.append(f"fabric ({f['source']}): inner {f['inner']['bus_gbps']:.1f} GB/s + "
                     f"{f['inner']['latency_us']:.0f} us, outer {f['outer']['bus_gbps']:.1f} "
                     f"GB/s + {f['outer']['latency_us']:.0f} us"
                     + (f"; sleep calibration error {max(map(abs, errs.values())):.2%}"
                        if errs else ""))
    print_rows(title, headers, cells, notes)
