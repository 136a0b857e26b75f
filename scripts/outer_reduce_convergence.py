"""Convergence of the compressed outer reduction, of hfsdp's compressed outer parameter
all-gather and of DiLoCo on real collectives (8 CPU ranks, gloo).

    nice -n 19 python scripts/outer_reduce_convergence.py --meshes 4x2 --out c42.json
    nice -n 19 python scripts/outer_reduce_convergence.py --meshes 2x4 --out c24.json
    nice -n 19 python scripts/outer_reduce_convergence.py --meshes 4x2:hfsdp \
        --runs "exact,int8 gather,int8+EF + int8 gather" --out g42.json
    python scripts/outer_reduce_convergence.py --out c42.json --table  # a (partial) run's
    nice -n 19 python scripts/outer_reduce_convergence.py --meshes 4x2 --layers 3 \
        --seeds 0,1 --runs "exact,DiLoCo H1 F1,DiLoCo H10 F4,..." --out diloco.json

Exact vs int8 + error feedback vs fp8 + error feedback vs fp8 without, on 4x2 and 2x4
meshes (hsdp) by default (``--runs``: also the outer all-gather's runs, on an hfsdp
mesh), 3 seeds, a small Llama (``hsdp_tools.bench.convergence.MODEL``) trained with AdamW
for ``--steps`` steps (``hsdp_tools/bench/convergence.py`` says what runs). Prints the markdown
table of docs/benchmarks.md and writes every loss curve to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hsdp_tools.bench.convergence import RUNS, Plan, convergence_job, summarize  # noqa: E402

REDUCTION_RUNS = ("exact", "int8+EF", "fp8+EF", "fp8 no EF")


def _entry(rank: int, world: int, port: int, plan: Plan, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    done = {}

    def write(key: str, losses: list[float]) -> None:  # after each run: partial results stay
        done[key] = losses
        if rank == 0:
            Path(out).write_text(json.dumps({"plan": plan.__dict__, "curves": done}))

    try:
        convergence_job(rank, world, plan, write)
    finally:
        dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    lines = ["| mesh | run | seeds | final loss mean [min-max] | minus exact mean | "
             "exact seed spread | largest gap of one step to exact |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mesh']} | {r['run']} | {r['seeds']} | {r['final_mean']:.4f} "
                     f"[{r['final_min']:.4f}-{r['final_max']:.4f}] | {r['vs_exact']:+.4f} "
                     f"| {r['exact_spread']:.4f} | {r['max_step_gap']:.4f} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[float]], png: str, window: int) -> None:
    """Each (mesh, run)'s loss, mean over its seeds, as a moving average of ``window``
    steps; one panel per mesh."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, dict[str, list[list[float]]]] = {}
    for key, losses in curves.items():
        mesh, _, run = key.split("/")
        runs.setdefault(mesh, {}).setdefault(run, []).append(losses)
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.5), squeeze=False)
    for ax, (mesh, by_run) in zip(axes[0], runs.items()):
        for run, seeds in by_run.items():
            steps = min(map(len, seeds))
            mean = [sum(s[i] for s in seeds) / len(seeds) for i in range(steps)]
            smooth = [sum(mean[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
                      for i in range(steps)]
            ax.plot(range(1, steps + 1), smooth, label=f"{run} ({len(seeds)} seeds)",
                    lw=2.2 if run == "exact" else 1.2, color="black" if run == "exact" else None)
        lowest = min(line.get_ydata().min() for line in ax.get_lines())
        ax.set_ylim(lowest - 0.05, lowest + 0.8)  # the end of the runs, where they differ
        ax.set(title=f"{mesh}: loss (mean over seeds, moving average of {window} steps)",
               xlabel="step", ylabel="loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--meshes", default="4x2,2x4", help="OUTERxINNER[:strategy],...")
    ap.add_argument("--runs", default=",".join(REDUCTION_RUNS),
                    help=f"comma-separated among: {', '.join(RUNS)}")
    ap.add_argument("--layers", type=int, default=2, help="Llama blocks (DiLoCo F=4: 3)")
    ap.add_argument("--tail", type=int, default=20, help="final loss: mean of the last N")
    ap.add_argument("--out", "--json", dest="out", default="outer_reduce_convergence.json")
    ap.add_argument("--table", action="store_true", help="only print --out's table")
    ap.add_argument("--png", default=None, help="with --table: also plot --out's curves here")
    args = ap.parse_args()
    if args.table:
        curves = json.loads(Path(args.out).read_text())["curves"]
        print(table(summarize(curves, args.tail)))
        if args.png:
            plot(curves, args.png, args.tail)
        return
    meshes = []
    for m in args.meshes.split(","):
        shape, _, strategy = m.partition(":")
        outer, inner = (int(x) for x in shape.split("x"))
        meshes.append((outer, inner, strategy or "hsdp"))
    plan = Plan(tuple(meshes), tuple(int(s) for s in args.seeds.split(",")),
                tuple(args.runs.split(",")), args.steps, args.layers)
    world = meshes[0][0] * meshes[0][1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    mp.start_processes(_entry, args=(world, port, plan, args.out), nprocs=world,
                       start_method="spawn")
    curves = json.loads(Path(args.out).read_text())["curves"]
    print(f"{len(curves)} runs of {args.steps} steps in {time.monotonic() - start:.0f} s")
    print(table(summarize(curves, args.tail)))


if __name__ == "__main__":
    main()
