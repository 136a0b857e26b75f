"""Step time with fault tolerance on or off (issue 28's cost), one GPU, one process.

    PYTHONPATH=src python scripts/ft_cost.py --ft on --seq 4096 --out out/ft_on_4096.json

One replica group of one rank. ``--ft on``: the lighthouse runs in this process and the
mesh is ``init_mesh(1, 1, fault_tolerance=...)``: each step starts with torchft's quorum,
the outer all-reduce goes through torchft's managed group (of one replica) on hsdp's outer
stream, and ``should_commit()`` gates the optimizer step. ``--ft off``: plain hsdp on a
(1, 1) mesh (no outer reduction at all), so the difference is everything fault tolerance
adds to a step. Timing: CUDA-synchronized wall time per step after a warm-up; the JSON
holds the median, min and max in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import hsdp
from hsdp.models import build_model, lm_loss, preset, shard_units


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ft", choices=("on", "off"), required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", "--json", dest="out", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test of the script (gloo, no timing meaning)")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29731"),
                      RANK="0", WORLD_SIZE="1")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    lighthouse = None
    ft = None
    if args.ft == "on":
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000,
                                      quorum_tick_ms=100)
        ft = hsdp.FaultTolerance(lighthouse=lighthouse.address(), replica_id="0",
                                 timeout=timedelta(seconds=120))
    mesh = hsdp.init_mesh(1, 1, device_type=args.device, fault_tolerance=ft)
    cfg = preset("gpt-1b", layers=args.layers, seq=args.seq)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = build_model(cfg)
    mp = hsdp.MixedPrecision(param_dtype=torch.bfloat16 if cuda else None,
                             reduce_dtype=torch.float32)
    for unit, reshard in shard_units(model):
        hsdp.fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    hsdp.fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    manager = hsdp.fault_tolerance(model, opt) if ft is not None else None
    tokens = torch.randint(0, cfg.vocab, (1, args.seq), device=args.device,
                           generator=torch.Generator(args.device).manual_seed(1))
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        if manager is not None:
            manager.start_quorum()
        lm_loss(model(tokens), tokens).backward()
        if manager is None or manager.should_commit():
            opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    hsdp.synchronize(model)
    result = {"ft": args.ft, "seq": args.seq, "layers": args.layers, "model": "gpt-1b",
              "steps": args.steps, "median_ms": statistics.median(times),
              "min_ms": min(times), "max_ms": max(times), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "committed": None if manager is None else manager.current_step()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    if manager is not None:
        manager.shutdown(wait=False)
    if lighthouse is not None:
        lighthouse.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
