"""Measure every table of docs/benchmarks.md again: its bench step / collectives / ckpt runs.

    python -m hsdp bench suite --out results/              # two H200s, megatron-fsdp installed
    python -m hsdp bench suite --out results/ --dry-run    # the runs it would make, per table
    python -m hsdp bench suite --out r/ --tables "Collective overlap on CPU ranks" \\
        --extra-args "--sizes 64KiB --iters 1 --warmup 0"  # one table, smaller (a check)

Each run is a subprocess (``python -m hsdp ...``: its own CUDA context and communicators)
that writes ``<out>/<folder>/<name>.json`` (compact; ``docs/results/`` has the same
layout) and its log beside it. A ``bench step`` run's Chrome traces go under
``--trace-dir`` (git-ignored ``out/`` by default): beside its JSON the suite keeps only
what the simulator's calibration reads of them (``hsdp_tools.sim.trace_phases.save_phases``), so
``scripts/sim_vs_measured.py`` runs on ``<out>`` as on ``docs/results``. Runs that fail
or time out are reported and the suite goes on; it exits 1 if any did.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

# The headings of docs/benchmarks.md's tables, each filled by the runs below.
STEP = "Step time on two H200s"
TWINS = "Emulation against real NCCL"
SLOW_OUTER = "Slow outer link"
MICROBATCHES = "Four microbatches"
SHARED_LINKS = "Two communicators on the same links"
CPU_OVERLAP = "Collective overlap on CPU ranks"
CHECKPOINT = "Checkpoint save"
FLOAT8 = "Float8 (torchao) on one H200"
FLOAT8_LOSS = "Float8 loss curves on one H200"
FAULT_TOLERANCE = "Fault tolerance (torchft) on one H200"
TP = "Tensor parallelism (emulated 16x8x8) on one H200"
TORCHTITAN = "torchtitan's trainer on one H200"
QUANT = "Quantization kernels on one H100"
OUTER_KERNELS = ("Compressed outer reduction and gather with the fused kernels, emulated 16x8 "
                 "on one H200")
CONVERGENCE = "Compressed outer reduction: convergence (8 CPU ranks)"
GATHER_CONVERGENCE = "Compressed outer all-gather: convergence (8 CPU ranks)"
DILOCO = "DiLoCo loss curves on CPU (8 ranks)"
DILOCO_STEP = "DiLoCo step time and outer bytes (emulated 16x8, and predicted for H200)"
TORCHTITAN_GRAPHS = "torchtitan's trainer on one H200 with CUDA graphs"
GRAPHS = "Step replayed as CUDA graphs (emulated 16x8) on one H200"
MOE = "Mixture of experts with expert parallelism (emulated 16x8, ep 8) on one H200"
PIPELINE = "Pipeline parallelism: the outer reduction in the drain (simulated, Llama 3 405B)"
TABLES = (STEP, TWINS, SLOW_OUTER, OUTER_KERNELS, QUANT, CONVERGENCE,
          GATHER_CONVERGENCE, DILOCO,
          DILOCO_STEP, MICROBATCHES, SHARED_LINKS, CPU_OVERLAP, CHECKPOINT, FLOAT8, FLOAT8_LOSS,
          FAULT_TOLERANCE, TP, TORCHTITAN, TORCHTITAN_GRAPHS, GRAPHS, MOE, PIPELINE)

# 5 recorded and 3 profiled steps per schedule: the simulator's calibration takes the
# median host time and least device time over them (hsdp_tools.sim.calibrate).
STEP_ARGS = ("bench", "step", "--reduce-dtype", "bf16", "--record-steps", "5",
             "--trace-steps", "3", "--warmup", "2")
# Multicast (NVLS) off on multi-GPU machines (docs/design.md, "Testing on CPU and GPU").
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass(frozen=True)
class Run:
    """One subprocess of the suite: ``python -m hsdp <argv>`` writing ``<folder>/<name>``."""

    table: str
    folder: str
    name: str
    argv: tuple[str, ...]
    timeout_s: int = 600
    env: tuple[tuple[str, str], ...] = ()
    program: tuple[str, ...] = ("-m", "hsdp")  # or a script of the repository

    def command(self, out: Path, trace_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
        """The command line, writing its JSON (and a step run's traces) where they go;
        ``{out}`` in an argument is ``out``."""
        cmd = [sys.executable, *self.program, *self.argv, *extra, "--json", str(self.json(out))]
        if self.argv[:2] == ("bench", "step"):
            cmd += ["--out-dir", str(trace_dir / self.name)]
        return [a.replace("{out}", str(out)) for a in cmd]

    def json(self, out: Path) -> Path:
        return out / self.folder / f"{self.name}.json"


def _step(table: str, name: str, *argv: str, timeout_s: int = 150) -> Run:
    return Run(table, f"h200x2/{name}", name, (*STEP_ARGS, *argv), timeout_s)


def plan() -> list[Run]:
    """Every run of every table, in the order they run (the collectives first: the
    emulated twins of the real rows fit their fabric to them)."""
    runs = [Run(TWINS, "h200x2", f"coll{m}", ("bench", "collectives", "--mesh", m, "--sizes",
                                             "4MiB,64MiB,256MiB", "--iters", "5", "--warmup",
                                             "2"), 120) for m in ("1x2", "2x1")]
    schedules = "overlap,serial,fsdp2,mfsdp"
    for q in ("1024", "4096"):
        runs.append(_step(STEP, f"emu16x8_s{q}", "--emulate", "--mesh", "16x8", "--seq", q,
                          "--steps", "5", "--schedules", schedules))
    for q in ("1024", "4096"):
        steps = "8" if q == "1024" else "5"
        runs.append(_step(STEP, f"real1x2_s{q}", "--mesh", "1x2", "--seq", q, "--steps", steps,
                          "--schedules", schedules))
        # 2x1: each GPU holds a whole replica; four schedules' models side by side leave
        # too little room (allocator retries time memory pressure, not schedules), so
        # Megatron-FSDP runs beside a second hsdp overlap in a process of its own.
        runs.append(_step(STEP, f"real2x1_s{q}", "--mesh", "2x1", "--seq", q, "--steps", steps,
                          "--schedules", "overlap,serial,fsdp2"))
        runs.append(_step(STEP, f"real2x1_s{q}_mfsdp", "--mesh", "2x1", "--seq", q, "--steps",
                          steps, "--schedules", "overlap,mfsdp"))
    for m in ("1x2", "2x1"):
        for q in ("1024", "4096"):
            runs.append(_step(TWINS, f"emu{m}_s{q}", "--emulate", "--mesh", m, "--seq", q,
                              "--steps", "5", "--schedules", "overlap,serial",
                              "--fabric-json", f"{{out}}/h200x2/coll{m}.json"))
    runs.append(_step(SLOW_OUTER, "emu2x4_s4096_outer12.5", "--emulate", "--mesh", "2x4",
                      "--seq", "4096", "--outer-gbps", "12.5", "--steps", "5", "--schedules",
                      "overlap,serial,hfsdp,hfsdp-serial"))
    runs.append(Run(QUANT, "h100", "quant_kernels", ("bench", "quant"), 600))
    # scripts/outer_reduce_gpu.sh's 12.5 GB/s row and kernels (its 47 and 3 GB/s step JSONs
    # were not kept: the table says so)
    runs.append(Run(OUTER_KERNELS, "h200/outer_reduce_kernels", "step_s4096_outer12.5",
                    ("bench", "step", "--mesh", "16x8", "--layers", "8", "--hidden", "4096",
                     "--heads", "32", "--kv-heads", "8", "--ffn", "14336", "--vocab", "32768",
                     "--mbs", "1", "--reduce-dtype", "bf16", "--record-steps", "2",
                     "--trace-steps", "1", "--warmup", "2", "--emulate", "--seq", "4096",
                     "--steps", "3", "--outer-reduce", "int8", "--outer-gather", "int8",
                     "--schedules", "overlap,overlap-q,hfsdp,hfsdp-q,hfsdp-qg,fsdp2",
                     "--outer-gbps", "12.5"), 300))
    runs.append(Run(OUTER_KERNELS, "h200/outer_reduce_kernels", "quant", ("bench", "quant"),
                    600))
    for mesh in ("4x2", "2x4"):  # CPU gloo ranks, 500 steps x 3 seeds x 4 runs
        runs.append(Run(CONVERGENCE, "cpu", f"outer_reduce_convergence_{mesh}",
                        ("--meshes", mesh), 3600,
                        program=("scripts/outer_reduce_convergence.py",)))
    runs.append(Run(GATHER_CONVERGENCE, "cpu", "outer_gather_convergence_4x2",
                    ("--meshes", "4x2:hfsdp", "--runs",
                     "exact,int8 gather,int8+EF + int8 gather"), 3600,
                    program=("scripts/outer_reduce_convergence.py",)))
    runs.append(Run(DILOCO, "cpu", "diloco_convergence_4x2",
                    ("--meshes", "4x2", "--layers", "3", "--seeds", "0,1", "--steps", "1000",
                     "--runs", "exact,DiLoCo H10 F1,DiLoCo H10 F4,DiLoCo H50 F1,DiLoCo H50 F4,"
                     "DiLoCo H1 F1"), 7200,
                    program=("scripts/outer_reduce_convergence.py",)))
    # CPU ranks with links slowed 200x, the simulator's H200 prediction beside each row
    runs.append(Run(DILOCO_STEP, "cpu", "diloco_bench_16x8",
                    ("bench", "diloco", "--link-scale", "0.005", "--steps", "3", "--warmup",
                     "1", "--repeats", "3"), 3600))
    runs.append(_step(MICROBATCHES, "emu16x8_s1024_mb4", "--emulate", "--mesh", "16x8",
                      "--seq", "1024", "--microbatches", "4", "--steps", "4", "--warmup", "1",
                      "--schedules", "overlap,serial"))
    for order in ("0", "1"):
        for ctas, tag in ((), "default_ctas"), (("--max-ctas", "inner=16,outer=8"), "ctas_16_8"):
            runs.append(Run(SHARED_LINKS, "h200x2/shared_links",
                            f"order_implicit_{'on' if order == '1' else 'off'}_{tag}",
                            ("bench", "collectives", "--mesh", "1x2", "--shared-links", *ctas,
                             "--iters", "10", "--warmup", "3"), 120,
                            (("NCCL_LAUNCH_ORDER_IMPLICIT", order),)))
    runs.append(Run(CPU_OVERLAP, "cpu", "collectives_gloo_2x2",
                    ("bench", "collectives", "--device", "cpu", "--nproc", "4", "--mesh", "2x2",
                     "--sizes", "4MiB,16MiB,64MiB", "--dtype", "fp32", "--iters", "10",
                     "--warmup", "2"), 300))
    runs.append(Run(CHECKPOINT, "h200", "ckpt", ("bench", "ckpt", "--nproc", "1", "--layers",
                                                 "2", "--repeats", "2"), 300))
    f8 = ("bench", "step", "--emulate", "--mesh", "16x8", "--layers", "8", "--steps", "10",
          "--warmup", "3", "--record-steps", "1", "--trace-steps", "1")
    for q in ("4096", "8192"):  # torchao installed (hsdp[float8])
        runs.append(Run(FLOAT8, "h200/float8", f"float8_seq{q}",
                        (*f8, "--seq", q, "--float8", "--schedules", "overlap,fsdp2"), 300))
        runs.append(Run(FLOAT8, "h200/float8", f"bf16_seq{q}",
                        (*f8, "--seq", q, "--schedules", "overlap"), 300))
    runs.append(Run(FLOAT8_LOSS, "h200/float8", "loss_curves",
                    ("--runs", ",".join(f"{lib}-{kind}" for kind in ("f8", "bf16", "f8-rowwise",
                                                                     "f8-compiled")
                                        for lib in ("hsdp", "fsdp2"))), 570,
                    program=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             "1", "scripts/float8_loss.py")))
    # torchft installed (hsdp[ft]); off and on alternated; 8 and 32 layers; AdamW foreach,
    # and fused (torchtitan's default) at seq 4096
    for q, layers, tag, optimizers in (("1024", "8", "", ("foreach",)),
                                       ("4096", "8", "", ("foreach", "fused")),
                                       ("4096", "32", "_l32", ("foreach", "fused"))):
        for optimizer in optimizers:
            fused = "_fused" if optimizer == "fused" else ""
            for k in ("1", "2"):
                for ft in ("off", "on"):
                    runs.append(Run(FAULT_TOLERANCE, "h200/ft_cost",
                                    f"seq{q}{tag}{fused}_{ft}_{k}",
                                    ("--ft", ft, "--seq", q, "--layers", layers, "--optimizer",
                                     optimizer), 300, program=("scripts/ft_cost.py",)))
    # 70B-shaped layers, TP 8 inside each DP rank; inner and outer both on the IB link
    runs.append(Run(TP, "h200/tp", "emu16x8x8_s4096",
                    ("bench", "step", "--emulate", "--mesh", "16x8", "--tp", "8", "--arch",
                     "llama", "--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--ffn",
                     "28672", "--vocab", "128256", "--layers", "8", "--seq", "4096",
                     "--inner-gbps", "47", "--schedules", "overlap,serial,fsdp2", "--steps",
                     "10", "--warmup", "3", "--record-steps", "1", "--trace-steps", "1"), 300))
    # torchtitan's own trainer, hsdp against its FSDP2 (with and without CUDA graphs), the
    # debugmodel and 1B flavors, 50 steps each (./wheels: the extra's wheels for the GPU image)
    runs.append(Run(TORCHTITAN, "h200/torchtitan", "llama3_1x1", ("bench",), 900,
                    program=("scripts/torchtitan_gpu.py",)))
    # the same runs alternated twice (A B C D A B C D): min-max per backend
    runs.append(Run(TORCHTITAN_GRAPHS, "h200/torchtitan", "llama3_1x1_graphs", ("bench",), 1800,
                    env=(("REPEATS", "2"),), program=("scripts/torchtitan_gpu.py",)))
    # scripts/graphs_gpu.sh and scripts/moe_gpu.sh run the same (one H200)
    one_gpu = ("bench", "step", "--reduce-dtype", "bf16", "--record-steps", "1",
               "--trace-steps", "1", "--warmup", "3", "--emulate", "--mesh", "16x8")
    for q in ("1024", "4096"):
        runs.append(Run(GRAPHS, "h200/graphs", f"emu16x8_s{q}_graphs",
                        (*one_gpu, "--seq", q, "--steps", "8", "--schedules",
                         "overlap,overlap-graph,serial,serial-graph,fsdp2"), 300))
    runs.append(Run(MOE, "h200/moe", "emu16x8_moe_ep8_s4096",
                    (*one_gpu, "--arch", "moe", "--ep", "8", "--seq", "4096", "--steps", "15",
                     "--schedules", "overlap,overlap-graph,serial,hfsdp,fsdp2"), 400))
    for gbps in ("47", "12.5"):  # the simulator alone (no device)
        runs.append(Run(PIPELINE, "cpu/pipeline", f"sim_405b_pp8_tp8_outer{gbps}",
                        ("--nodes", "16,32,64,128", "--pp", "8", "--tp", "8", "--microbatches",
                         "16", "--strategy", "hfsdp", "--outer-gbps", gbps), 300,
                        program=("-m", "hsdp_tools.sim.pipeline")))
    return runs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results", help="where the JSONs go (default ./results)")
    p.add_argument("--trace-dir", default="out/bench_suite",
                   help="Chrome traces of the step runs (default ./out/bench_suite)")
    p.add_argument("--tables", default=None, metavar="NAME,...",
                   help=f"only these tables (default: all of {'; '.join(TABLES)})")
    p.add_argument("--extra-args", default="", metavar="ARGS",
                   help="appended to every run's command (e.g. fewer iterations, as a check)")
    p.add_argument("--dry-run", action="store_true", help="print the runs, run nothing")


def selected(tables: str | None) -> list[Run]:
    """The plan's runs of ``tables`` (comma-separated headings; None: all)."""
    names = TABLES if tables is None else tuple(t.strip() for t in tables.split(","))
    unknown = [t for t in names if t not in TABLES]
    if unknown:
        raise SystemExit(f"bench suite: unknown table(s) {unknown}; tables: {list(TABLES)}")
    return [r for r in plan() if r.table in names]


def execute(run: Run, out: Path, trace_dir: Path, extra: tuple[str, ...] = ()) -> bool:
    """Run one, its log beside its JSON; compact the JSON, save a step run's phases."""
    path = run.json(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = run.command(out, trace_dir, extra)
    env = os.environ | ENV | dict(run.env)
    with open(path.with_suffix(".log"), "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=run.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    ok = rc == 0 and path.exists()
    print(f"[{run.table}] {run.name}: {'ok' if ok else f'failed ({rc})'}", flush=True)
    if ok:
        path.write_text(json.dumps(json.loads(path.read_text()), separators=(",", ":")))
        if run.argv[:2] == ("bench", "step"):
            from hsdp_tools.sim.trace_phases import save_phases  # a tool of the simulator's

            save_phases(path)
    return ok


def run(args: argparse.Namespace) -> int:
    runs = selected(args.tables)
    out, trace_dir = Path(args.out), Path(args.trace_dir)
    extra = tuple(shlex.split(args.extra_args))
    if args.dry_run:
        for r in runs:
            env = " ".join(f"{k}={v}" for k, v in r.env)
            cmd = shlex.join(r.command(out, trace_dir, extra)[1:])
            print(f"[{r.table}] {env + ' ' if env else ''}python {cmd}")
        return 0
    failed = [r.name for r in runs if not execute(r, out, trace_dir, extra)]
    if failed:
        print(f"bench suite: {len(failed)} of {len(runs)} runs failed: {', '.join(failed)}")
    return 1 if failed else 0
