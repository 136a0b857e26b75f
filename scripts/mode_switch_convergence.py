"""A run that switches the outer axis's mode across resumes against exact runs (8 CPU
ranks, gloo, 4x2).

    nice -n 19 python scripts/mode_switch_convergence.py \
        --out docs/results/cpu/mode_switch_convergence_8.json

For each seed: the exact run (``hsdp_tools.bench.convergence``'s small Llama, AdamW, its
synthetic data) and a run of the same steps cut into four equal phases, exact -> int8 +
error feedback -> DiLoCo H=10 -> exact, each a new model in its mode resumed by
``hsdp.load`` from the checkpoint ``hsdp.save`` wrote at the end of the previous phase
(docs/guide/checkpoints.md: the residuals start from zero, DiLoCo starts afresh, and a
DiLoCo phase of a multiple of 10 steps ends at a sync, where every replica equals the
anchor). Writes every loss curve and the verdict: the switched runs' final loss (mean of
the last ``--tail`` steps, over seeds) minus the exact runs', against the exact runs'
spread over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hsdp_tools.bench.convergence import summarize  # noqa: E402
from hsdp_tools.bench.mode_switch import PHASES, verdict, world_job  # noqa: E402


def _entry(rank: int, world: int, port: int, args: argparse.Namespace, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    done: dict[str, list[float]] = {}
    plan = {"mesh": [4, 2], "seeds": args.seeds, "steps": args.steps, "phases": PHASES,
            "tail": args.tail}

    def write(key: str, losses: list[float]) -> None:  # after each run: partial results stay
        done[key] = losses
        if rank == 0:
            Path(args.out).write_text(json.dumps({"plan": plan, "curves": done}, indent=1))

    try:
        world_job(rank, world, args.seeds, args.steps, root, write)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="a multiple of 40")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    ap.add_argument("--tail", type=int, default=20, help="final loss: mean of the last N")
    ap.add_argument("--out", default="mode_switch_convergence_8.json")
    args = ap.parse_args()
    if args.steps % 40:
        raise SystemExit("--steps must be a multiple of 40 (4 phases, DiLoCo H=10 ending at a "
                         "sync)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        mp.start_processes(_entry, args=(8, port, args, root), nprocs=8, start_method="spawn")
    result = json.loads(Path(args.out).read_text())
    result["verdict"] = verdict(result["curves"], args.tail)
    result["summary"] = summarize(result["curves"], args.tail)
    result["wall_s"] = time.monotonic() - start
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{len(result['curves'])} runs of {args.steps} steps in {result['wall_s']:.0f} s")
    print(json.dumps(result["verdict"], indent=1))


if __name__ == "__main__":
    main()
