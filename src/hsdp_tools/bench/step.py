"""Step bench: training step time and memory of hsdp's schedules and its peers on one model.

Schedules: see ``hsdp_tools.bench.trainee`` (hsdp overlap / serial, hfsdp, torch FSDP2,
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
   ``--run-steps N``: then, one schedule at a time, N more steps back to back with every
   stream drained once at the end (barriers around them), ``t_run`` = their wall time / N
   (slowest rank): what a training loop sees, where what one step leaves on a side stream
   (hfsdp's outer all-gather after the optimizer step) overlaps the next step's forward.
   Not for the -graph schedules (their replay drains each step);
4. memory per phase (GPU): one more step per schedule with the peak of each phase
   (forward, backward, optimizer: ``torch.cuda.max_memory_allocated`` between phase ends)
   less what the other schedules' models hold, so each figure is what the schedule would
   need alone; the peak over the timed steps is reported the same way;
5. recorded: ``--record-steps`` more interleaved steps per schedule without the profiler,
   with the schedule's tracer on (outside the timed steps: the tracer costs host time).
   Each hsdp schedule keeps, per step, its host marks (phase marks and side-op submits,
   ``hsdp_tools.bench.trace.host_marks``) and, on GPU, each side op's time on its stream
   (timing events, ``Tracer.side_ms``): the simulator's calibration combines them over the
   steps (``hsdp_tools.sim.calibrate``); on GPU also when the compute stream reached each phase
   mark (``Tracer.device_marks``: how far the device ran behind the host). CPU: the first
   step's stream records also give the traced step's intervals (the profiler's per-op
   cost is large next to small CPU ops);
6. collective-free (``--emulate`` only): ``--steps`` more interleaved steps with the
   emulated delays off, so collectives take no time at all (torch's fake process group
   launches nothing), next to the ``unsharded`` reference: the same layers unsharded plus
   AdamW over one rank's shard (``hsdp_tools.bench.trainee``). Their ratio is the overhead of the
   sharding machinery itself;
7. trace: ``--trace-steps`` more interleaved steps per schedule, each under its own
   ``torch.profiler`` session, with the schedule's tracer on (hsdp's root unit tracer; the
   peers' collectives are intercepted, see ``hsdp_tools.bench.intercept``). Rank 0 writes the
   Chrome traces to ``--out-dir``: ``trace_<schedule>.json.gz`` for the first profiled
   step, ``trace_<schedule>.<k>.json.gz`` for the k-th (k = 2..N; the JSON's ``traces``
   lists them all, ``trace`` names the first). The first step's intervals (GPU: from its
   Chrome trace; CPU: from the recorded step) give the metrics
   (``hsdp_tools.report.metrics.step_metrics``) and one timeline PNG; the further traces are
   for the calibration (a kernel slowed down, e.g. beside NCCL kernels waiting for a
   peer, is only ever slower: it takes the least device time per phase).

Lower bound: ``max(compute + tail, inner, outer)`` from each schedule's traced step,
with compute / inner / outer the busy time of each resource and tail the duration of
the last outer reduction (it cannot start before the last backward kernel ends; the
floor of ``outer_tail``, docs/design.md "What is measured"). The tail is attached to the
compute chain it must follow, which keeps it a true bound when communication dominates.

Comparisons (``hsdp_tools.report.compare``): overlapped vs serialized, and each hsdp schedule vs
each peer: no verdict under 5 timed steps, "within noise" when the two schedules' min-max
step-time ranges overlap, each one's spread otherwise; on CPU labelled as schedule checks.

``--tp N``: tensor parallelism inside each data-parallel rank, on a 3-D (outer, inner, tp)
mesh (``hsdp.init_mesh(..., tp=N)``, tp fastest): every schedule's Llama gets torch's TP
plan on ``mesh["tp"]`` (``hsdp_tools.bench.tp_plan``), FSDP2 shards on ``mesh["outer", "inner"]``; a
TP group shares its tokens (global tokens count the outer x inner data-parallel ranks).
The TP collectives run where torch issues them, on the compute stream; under
``--emulate`` they are delayed there by their modelled time on the ``--tp-gbps`` link.

``-graph`` schedules (CUDA): the hsdp schedule's step captured in CUDA graphs after two
eager steps (warm-up) and replayed (``hsdp_tools.bench.graphed``): forward + backward in one
graph, the
optimizer step in another; its recorded steps record nothing (no hook runs in a replay),
its traced step's intervals come from the replay's kernels.

``--emulate``: one process posing as rank 0 of the mesh (torch's fake process group);
every collective first waits its modelled duration (``hsdp_tools.sim.fabric.Fabric``) on its own
stream: ``torch.cuda._sleep`` on GPU (calibrated; the error is reported), host sleeps on
hsdp's stream threads on CPU. ``--fabric-json`` fits the fabric to a ``bench
collectives`` JSON (see ``fabric_from_collectives``). ``--share-gpus``: several ranks per
GPU (``hsdp_tools.bench.launch``), for correctness only.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import hsdp
from hsdp.streams.contract import OpRecord
from hsdp_tools.bench.emulate import fake_mesh
from hsdp_tools.bench.launch import (
    host_barrier,
    launch,
    rank_process_group,
    select_cuda,
)
from hsdp_tools.bench.step_config import StepBenchConfig, add_arguments, resolve  # noqa: F401  (add_arguments: the command table)
from hsdp_tools.bench.step_results import report, results
from hsdp_tools.bench.trace import host_marks, intervals_from_chrome_trace, intervals_from_records
from hsdp_tools.bench.trainee import (
    PHASES,
    SCHEDULES,
    Trainee,
    build,
    build_unsharded,
    synthetic_batches,
)
from hsdp_tools.report.metrics import Interval


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
            report(bench(cfg, device, mesh), cfg)
        finally:
            dist.destroy_process_group()
        return 0
    return launch("bench step", _worker, lambda world: resolve(args, cuda, world), args.nproc,
                  cuda, bool(args.share_gpus))


def _worker(local_rank: int, cfg: StepBenchConfig, port: int | None) -> None:
    with rank_process_group(local_rank, cfg.world, port, cfg.cuda,
                            cfg.inner if cfg.share_gpus else None) as device:
        mesh = hsdp.init_mesh(cfg.outer, cfg.inner, device.type, tp=cfg.tp)
        result = bench(cfg, device, mesh)
        if dist.get_rank() == 0:
            report(result, cfg)


@contextmanager
def _oom_guard(schedule: str, cfg: StepBenchConfig) -> Iterator[None]:
    """Turn a CUDA out-of-memory error into a clear exit naming the schedule and model."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        raise SystemExit(f"hsdp bench step: out of memory on rank {dist.get_rank()} in "
                         f"schedule {schedule!r} with {cfg.describe()} on mesh "
                         f"{cfg.outer}x{cfg.inner}: {str(e).splitlines()[0]}") from None


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


def bench(cfg: StepBenchConfig, device: torch.device, mesh: DeviceMesh) -> dict:
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
                                  cfg.emulate, cfg.float8, cfg.tp_fabric, cfg.outer_reduce,
                                  cfg.outer_gather))
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
    if cfg.run_steps:
        for t in trainees:
            if t.graphed is None:
                with _oom_guard(t.name, cfg):
                    _run_steps(t, batches, cfg.run_steps)
        progress(f"back to back: {cfg.run_steps} steps of each eager schedule")
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
    traces = {t.name: (_intervals(t, paths[t.name][0], cpu_records.get(t.name))
                       if paths[t.name] else [], paths[t.name]) for t in trainees}
    progress(f"traced: {cfg.trace_steps} profiled steps of each schedule")
    return results(cfg, device, trainees, traces, reference)


def _record(cfg: StepBenchConfig, trainees: list[Trainee], batches: list[torch.Tensor],
            cuda: bool) -> dict[str, tuple[list[OpRecord], float, float]]:
    """The recorded steps (module docstring): each hsdp trainee's host marks and side-op
    stream times per step; returns, on CPU, each schedule's first recorded step (records,
    start, end) for its intervals."""
    first = {}
    for _ in range(cfg.record_steps):
        for t in trainees:
            # a replayed graph runs no hook: nothing to record of it
            hsdp_schedule = SCHEDULES[t.name].library == "hsdp" and t.graphed is None
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


def _run_steps(t: Trainee, batches: list[torch.Tensor], steps: int) -> None:
    """``t.run_ms``: ms per step of ``steps`` steps back to back (module docstring, 3)."""
    host_barrier()
    t0 = time.perf_counter()
    t.run(batches, steps)
    host_barrier()
    t.run_ms = (time.perf_counter() - t0) * 1e3 / steps


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


def _collective_free(cfg: StepBenchConfig, trainees: list[Trainee], batches: list[torch.Tensor],
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


def _trace(t: Trainee, batches: list[torch.Tensor], cfg: StepBenchConfig, k: int,
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


def _intervals(t: Trainee, trace: str,
               recorded: tuple[list[OpRecord], float, float] | None) -> list[Interval]:
    """The first profiled step's intervals: from its Chrome trace (GPU; a graphed
    trainee's replay as ``hsdp_tools.bench.graphed`` reads it), else from the CPU stream records
    ``recorded`` (records, start, end) of the first recorded step."""
    if t.graphed is not None:
        return t.graphed.intervals(trace)
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
