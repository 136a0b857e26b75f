"""Host time of ``optimizer.step()``: the same model and optimizer, plain vs hsdp.

    PYTHONPATH=src python scripts/optim_host.py --layers 32 --hidden 64
    PYTHONPATH=src python scripts/optim_host.py --optim sgd --profile 25
    python scripts/optim_host.py --device cuda --layers 32            # gpt-1b layers

One process (rank 0 of 1, gloo; ``cpu:gloo,cuda:nccl`` on CUDA). Two copies of a gpt-1b
shaped model from one seed: a plain ``nn.Module`` and one ``hsdp.fully_shard``-ed per unit
on a 1x1 mesh, each with its own optimizer (``--optim``). They are stepped in turn
(forward, backward, step, zero_grad); only ``opt.step()`` is timed, from a synchronized
device to its return: the host time of issuing the step, which is exposed on a GPU when
the device was synchronized before it (torchft's ``should_commit``). Prints, after
``--warmup`` steps, the median (min-max) wall ms per step of each, the median CPU time of
the calling thread and hsdp's excess over plain; a line of JSON too. ``--hidden`` shrinks
the model (heads of 64, ffn 4 x hidden) and ``--vocab`` its embedding, whose optimizer
compute dominates a CPU step otherwise, so that the time left is the host's.
``--profile N``: a cProfile of hsdp's timed steps (top N by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import hsdp  # noqa: E402
from hsdp_tools.models import build_model, lm_loss, preset, shard_units  # noqa: E402

OPTIMIZERS: dict[str, Callable] = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "adamw-forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False, fused=False),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
    "sgd-forloop": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=False),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=None,
                   help="a smaller model: hidden size (heads of 64, ffn 4 x hidden); "
                        "default 64 on cpu, gpt-1b's own on cuda")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=None,
                   help="a smaller vocabulary (less optimizer compute on CPU)")
    p.add_argument("--optim", choices=sorted(OPTIMIZERS), default="adamw-foreach")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    return p.parse_args()


def main() -> None:
    args = parse()
    cuda = args.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29751"))
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    hidden = args.hidden if args.hidden is not None else (None if cuda else 64)
    small = {} if hidden is None else dict(hidden=hidden, heads=max(1, hidden // 64),
                                           ffn=4 * hidden)
    if args.vocab is not None:
        small["vocab"] = args.vocab
    cfg = preset("gpt-1b", layers=args.layers, seq=args.seq, **small)
    models = {}
    for name in ("plain", "hsdp"):
        torch.manual_seed(0)
        with torch.device(args.device):
            models[name] = build_model(cfg)
    mesh = hsdp.init_mesh(1, 1, device_type=args.device)
    for unit, reshard in shard_units(models["hsdp"]):
        hsdp.fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    hsdp.fully_shard(models["hsdp"], mesh=mesh)
    opts = {n: OPTIMIZERS[args.optim](m.parameters()) for n, m in models.items()}
    tokens = torch.randint(0, cfg.vocab, (1, args.seq), device=args.device,
                           generator=torch.Generator(args.device).manual_seed(1))
    times: dict[str, list[float]] = {n: [] for n in models}
    cpu: dict[str, list[float]] = {n: [] for n in models}
    profile = cProfile.Profile() if args.profile else None
    for i in range(args.warmup + args.steps):
        for name, model in models.items():
            lm_loss(model(tokens), tokens).backward()
            if name == "hsdp":
                hsdp.synchronize(model)
            sync()
            timed = profile is not None and name == "hsdp" and i >= args.warmup
            if timed:
                profile.enable()
            start, start_cpu = time.perf_counter(), time.thread_time()
            opts[name].step()
            elapsed = (time.perf_counter() - start) * 1e3
            elapsed_cpu = (time.thread_time() - start_cpu) * 1e3
            if timed:
                profile.disable()
            sync()
            opts[name].zero_grad(set_to_none=True)
            if i >= args.warmup:
                times[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
    hsdp.synchronize(models["hsdp"])
    med = {n: statistics.median(t) for n, t in times.items()}
    med_cpu = {n: statistics.median(t) for n, t in cpu.items()}
    params = sum(1 for _ in models["plain"].parameters())
    print(f"{args.optim}, {args.layers} layers, hidden {cfg.hidden}, {params} params, "
          f"{args.device}, {args.steps} steps: opt.step() host ms, median (min-max); "
          f"thread CPU ms, median")
    for n, t in times.items():
        print(f"  {n:6s} {med[n]:8.2f} ({min(t):.2f}-{max(t):.2f})  cpu {med_cpu[n]:8.2f}")
    print(f"  excess {med['hsdp'] - med['plain']:8.2f} (hsdp - plain)"
          f"{'':15s}cpu {med_cpu['hsdp'] - med_cpu['plain']:8.2f}")
    print(json.dumps({"optim": args.optim, "layers": args.layers, "hidden": cfg.hidden,
                      "params": params, "device": args.device, "steps": args.steps,
                      "plain_ms": med["plain"], "hsdp_ms": med["hsdp"],
                      "excess_ms": med["hsdp"] - med["plain"], "plain_cpu_ms": med_cpu["plain"],
                      "hsdp_cpu_ms": med_cpu["hsdp"], "plain_min_ms": min(times["plain"]),
                      "hsdp_min_ms": min(times["hsdp"]),
                      "excess_cpu_ms": med_cpu["hsdp"] - med_cpu["plain"],
                      "torch": torch.__version__}))
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
