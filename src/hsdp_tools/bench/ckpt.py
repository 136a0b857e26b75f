"""bench ckpt: time hsdp.save against torch.distributed.checkpoint.save of FSDP2.

The same model (seed 0), mesh and AdamW state (after one step) is saved in turn by
``hsdp.save`` (sync, and async: the blocking part and the whole) and by DCP's ``save`` of
FSDP2 HSDP's ``get_state_dict``, interleaved ``--repeats`` times; a fresh hsdp model then
loads the last hsdp checkpoint and must equal the saved one bit for bit (the CUDA / NCCL
check of hsdp.load). Under torchrun it uses the given ranks; otherwise it spawns one rank
per GPU (or 4 CPU ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import hsdp
from hsdp.topology.communicators import host_group
from hsdp_tools.bench.launch import (
    add_layout_argument,
    check_shared_layout,
    launch,
    rank_process_group,
    select_cuda,
)
from hsdp_tools.models import build_model, lm_loss, preset
from hsdp_tools.report.args import parse_mesh


@dataclass(frozen=True)
class CheckpointBenchConfig:
    """``bench ckpt``'s resolved arguments, identical on every rank."""

    outer: int
    inner: int
    model: str
    overrides: tuple[tuple[str, int], ...]
    repeats: int
    root: str
    cuda: bool
    share_gpus: bool
    json_path: str | None

    @property
    def world(self) -> int:
        return self.outer * self.inner


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, help="OUTERxINNER (default 1xWORLD)")
    p.add_argument("--model", default="gpt-1b", help="model preset (hsdp_tools.models.PRESETS)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=INT",
                   help="override a field of the preset, e.g. --set hidden=64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary "
                                               "directory, removed after)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--json", default=None)
    add_layout_argument(p)


def run(args: argparse.Namespace) -> int:
    cuda = select_cuda(args.device, "bench ckpt")
    root = args.dir or tempfile.mkdtemp(prefix="hsdp-ckpt-")

    def resolve(world: int) -> CheckpointBenchConfig:
        outer, inner = parse_mesh(args.mesh) if args.mesh else (1, world)
        if outer * inner != world:
            raise SystemExit(f"hsdp bench ckpt: mesh {outer}x{inner} needs {outer * inner} "
                             f"ranks, got {world}")
        if args.share_gpus:
            check_shared_layout("bench ckpt", outer, inner, torch.cuda.device_count())
        overrides = (("layers", args.layers),) + tuple(
            (k, int(v)) for k, v in (kv.split("=", 1) for kv in args.set))
        return CheckpointBenchConfig(outer, inner, args.model, overrides, args.repeats, root,
                                     cuda, bool(args.share_gpus), args.json)

    try:
        return launch("bench ckpt", _worker, resolve, args.nproc, cuda, bool(args.share_gpus))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def _worker(local_rank: int, cfg: CheckpointBenchConfig, port: int | None) -> None:
    with rank_process_group(local_rank, cfg.world, port, cfg.cuda,
                            cfg.inner if cfg.share_gpus else None) as device:
        result = bench(cfg, device)
        if dist.get_rank() == 0:
            print(json.dumps(result, indent=1))
            if cfg.json_path:
                with open(cfg.json_path, "w") as f:
                    json.dump(result, f, indent=1)


def _trained(cfg: CheckpointBenchConfig, device: torch.device, sharded: str, mesh) -> tuple:
    """The model (seed 0) sharded by hsdp or FSDP2, after one AdamW step."""
    mcfg = preset(cfg.model, **dict(cfg.overrides))
    torch.manual_seed(0)
    model = build_model(mcfg).to(device)
    units = [*model.blocks, model]
    if sharded == "hsdp":
        mp = hsdp.MixedPrecision(torch.bfloat16, torch.float32)
        for m in units:
            hsdp.fully_shard(m, mesh=mesh, mp_policy=mp)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        for m in units:
            fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16,
                                                                     torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, mcfg.vocab, (1, min(mcfg.seq, 1024)), device=device,
                           generator=torch.Generator(device).manual_seed(dist.get_rank()))
    lm_loss(model(tokens), tokens).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _timed(fn) -> float:
    dist.barrier(group=host_group())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    dist.barrier(group=host_group())
    return time.perf_counter() - t


def bench(cfg: CheckpointBenchConfig, device: torch.device) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = hsdp.init_mesh(cfg.outer, cfg.inner, device.type)
    model, opt = _trained(cfg, device, "hsdp", mesh)
    peer, peer_opt = _trained(cfg, device, "fsdp2", mesh)
    hsdp_path = os.path.join(cfg.root, "hsdp")
    peer_path = os.path.join(cfg.root, "fsdp2")
    times: dict[str, list[float]] = {"hsdp.save": [], "hsdp.save async (blocking)": [],
                                     "hsdp.save async (until wait)": [],
                                     "dcp.save of FSDP2": []}

    def peer_save() -> None:
        if dist.get_rank() == 0:
            shutil.rmtree(peer_path, ignore_errors=True)
        msd, osd = get_state_dict(peer, peer_opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=peer_path,
                 process_group=host_group())

    for _ in range(cfg.repeats):
        times["hsdp.save"].append(_timed(lambda: hsdp.save(hsdp_path, model, opt)))
        times["dcp.save of FSDP2"].append(_timed(peer_save))
        handles: list = []
        blocking = _timed(lambda h=handles: h.append(hsdp.save(hsdp_path, model, opt,
                                                               async_save=True)))
        times["hsdp.save async (blocking)"].append(blocking)
        times["hsdp.save async (until wait)"].append(blocking + _timed(handles[0].wait))
    fresh, fresh_opt = _trained(cfg, device, "hsdp", mesh)  # same seed, one step on
    torch.manual_seed(1)
    with torch.no_grad():  # differ from the saved model and optimizer before loading
        for p in fresh.parameters():
            p.mul_(0.5)
            fresh_opt.state[p]["exp_avg"].mul_(0.5)
    hsdp.load(hsdp_path, fresh, fresh_opt)
    want, got = hsdp.full_state_dict(model), hsdp.full_state_dict(fresh)
    moments = all(torch.equal(opt.state[p]["exp_avg"].to_local(),
                              fresh_opt.state[q]["exp_avg"].to_local())
                  for p, q in zip(model.parameters(), fresh.parameters()))
    hsdp.synchronize(model)
    hsdp.synchronize(fresh)
    return {
        "config": asdict(cfg), "device": torch.cuda.get_device_name(device)
        if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "bytes_per_rank": sum(p.to_local().numel() * 4 * 3 for p in model.parameters()),
        "seconds": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                    for k, v in times.items()},
        "load_equal": moments and all(torch.equal(want[k], got[k]) for k in want),
    }
