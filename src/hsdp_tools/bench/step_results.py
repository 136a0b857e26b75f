"""``bench step``'s results: per-schedule step times and spreads, metrics of the traced
step, the run's metadata, the JSON and the printed table."""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

import hsdp
from hsdp_tools.bench.launch import (
    RECORDED_ENV,
    SHARED_LAYOUT_NOTE,
    bookkeeping_device,
)
from hsdp_tools.bench.mfsdp import import_mfsdp
from hsdp_tools.bench.step_config import GIB, GRAPH_PAIRS, PAIRS, StepBenchConfig
from hsdp_tools.bench.trainee import (
    PEERS,
    PHASES,
    SCHEDULES,
    Trainee,
)
from hsdp_tools.report.compare import CPU_NOTE, compare, describe
from hsdp_tools.report.metrics import Interval, step_metrics
from hsdp_tools.report.table import print_table as print_rows
from hsdp_tools.report.timeline import plot_timeline


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


def results(cfg: StepBenchConfig, device: torch.device, trainees: list[Trainee],
             traces: dict[str, tuple[list[Interval], list[str]]],
             reference: Trainee | None) -> dict:
    """Slowest rank per step and largest peak over ranks; metrics from rank 0's trace."""
    cuda = device.type == "cuda"
    steps = _worst([t.samples_ms for t in trainees], device)
    hosts = _worst([t.host_ms for t in trainees], device)
    frees = _worst([t.free_ms for t in trainees], device)
    runs = _worst([[t.run_ms or 0.0] for t in trainees], device)
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
            # --run-steps: ms per step back to back (None: not run)
            "t_run_ms": runs[i][0] if t.run_ms is not None else None,
            "peak_mem_bytes": int(peaks[i][0]) if cuda else None,
            "peak_mem_phase_bytes": (dict(zip(PHASES, map(int, peaks[i][1:]), strict=True))
                                     if cuda else None),
            "resident_mem_bytes": t.resident_bytes if cuda else None,
            # timed steps in which some rank's allocator retried (see allocator_retries)
            "alloc_retry_steps": sum(n > 0 for n in retries[i]) if cuda else None,
            "calibration_error": t.calibration_error,
            # -graph schedules: memory the graphs' pool reserved at capture (its
            # allocations are not in the peaks: a replay allocates nothing)
            "graph_pool_bytes": t.graphed.pool_bytes if t.graphed else None,
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
        return dict.fromkeys((*keys, "traced_step_ms", "metrics"))
    m = step_metrics(intervals)
    return {**{k: m[k] for k in keys}, "traced_step_ms": m["span_ms"], "metrics": m}


def _summary(schedules: dict[str, dict]) -> dict:
    pairs = [*PAIRS, *((h, p) for h in ("overlap", "hfsdp", "overlap-graph", "hfsdp-graph")
                       for p in PEERS), *GRAPH_PAIRS]
    return {f"{a}_vs_{b}": compare(schedules[a], schedules[b]) for a, b in pairs
            if a in schedules and b in schedules}


def _meta(cfg: StepBenchConfig, device: torch.device, trainees: list[Trainee]) -> dict:
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
        "outer_gather": asdict(cfg.outer_gather or hsdp.OuterGather()) if any(
            SCHEDULES[n].compressed_gather for n in cfg.schedules) else None,
        "fabric": None,
        "calibration_error": {t.name: t.calibration_error for t in trainees},
        "model": {**asdict(cfg.model), "mbs": cfg.mbs, "microbatches": cfg.microbatches,
                  "dtype": cfg.dtype, "reduce_dtype": cfg.reduce_dtype},
        "num_params": cfg.model.num_params,
        "global_tokens_per_step": cfg.global_tokens,
        "steps": cfg.steps, "warmup": cfg.warmup, "record_steps": cfg.record_steps,
        "trace_steps": cfg.trace_steps, "run_steps": cfg.run_steps,
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


def report(result: dict, cfg: StepBenchConfig) -> None:
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
               "fwd / bwd / opt GiB", "traced ms", "exposed comm ms", "outer tail ms",
               "comm-comm overlap ms", "lower bound ms"]
    run = any(s.get("t_run_ms") is not None for s in result["schedules"].values())
    if run:
        headers.insert(3, "back-to-back ms")
    cells = []
    for name, s in result["schedules"].items():
        phases = s["peak_mem_phase_bytes"]
        cells.append([name, f"{s['t_step_ms']:.2f} [{s['t_step_min_ms']:.2f}-"
                            f"{s['t_step_max_ms']:.2f}]", _ms(s["t_host_ms"]),
                      *([_ms(s["t_run_ms"])] if run else []),
                      _ms(s["t_free_ms"]), f"{s['tokens_per_s']:,.0f}",
                      _gib(s["peak_mem_bytes"]),
                      " / ".join(_gib(phases[p]) for p in PHASES) if phases else "-",
                      _ms(s.get("traced_step_ms")), _ms(s["exposed_comm_ms"]),
                      _ms(s["outer_tail_ms"]),
                      _ms(s["comm_comm_overlap_ms"]), _ms(s["lower_bound_ms"])])
    ref = result.get("reference")
    if ref:
        cells.append([f"{ref['name']} (reference)", "-", _ms(ref["t_host_ms"]),
                      *(["-"] if run else []), _ms(ref["t_step_ms"]), *["-"] * 8])
    notes = ["traced: one profiled step (first op to last), slower than the timed steps "
             "under the profiler; exposed / tail / overlap / lower bound are of that step",
             "lower bound = max(compute + tail, inner, outer): busy ms in the traced step "
             "(tail: its last outer reduction; compute and tail counted once where they "
             "overlap), at most its traced ms: compare it with that, not with t_step",
             "host: time to issue the step; peak: over the timed steps, and per phase in "
             "one more step, without the other schedules' models"]
    if run:
        notes.append(f"back-to-back: per step, {m['run_steps']} steps of one schedule in a "
                     f"row, drained once (a side stream's work overlaps the next step)")
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
