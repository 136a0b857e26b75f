"""CUDA checks run in a fresh process each (one process group per process).

    python tests/gpu/cuda_child.py world1|trace|memory|intercept [args]   -> prints one JSON line
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import types

import torch
import torch.distributed as dist
import torch.nn as nn

import hsdp
from hsdp.streams.contract import Tracer
from hsdp_tools.bench.emulate import SleepClock, emulate, fake_mesh
from hsdp_tools.bench.intercept import intercept
from hsdp_tools.bench.trace import intervals_from_chrome_trace
from hsdp_tools.models import GPT, GPTConfig, lm_loss
from hsdp_tools.report.metrics import step_metrics
from hsdp_tools.sim.fabric import Fabric, Link

DEV = torch.device("cuda", 0)


def _shard(model: GPT, mesh, **kw) -> GPT:
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, **kw)
    return hsdp.fully_shard(model, mesh=mesh, **kw)


def world1() -> dict:
    """Real NCCL, world size 1: every strategy equals the unsharded reference."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29561"),
                      RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=DEV)
    cfg_ctas = hsdp.NcclConfig(max_ctas=8, min_ctas=1)  # exercises per-communicator options
    mesh = hsdp.init_mesh(1, 1, "cuda", nccl={"inner_ag": cfg_ctas, "inner_rs": cfg_ctas,
                                              "outer": hsdp.NcclConfig(max_ctas=4)})
    cfg = GPTConfig(vocab=101, hidden=96, heads=4, ffn=200, layers=3, seq=32,
                    checkpoint="non_reentrant")
    out = {}
    for strategy in ("hsdp", "hfsdp"):
        for overlap in (True, False):
            torch.manual_seed(0)
            ref = GPT(cfg).to(DEV)
            model = _shard(copy.deepcopy(ref), mesh, strategy=strategy, overlap_outer=overlap)
            opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
            for step in range(4):
                tokens = torch.randint(0, cfg.vocab, (4, cfg.seq), device=DEV,
                                       generator=torch.Generator(DEV).manual_seed(step))
                for m, opt in zip((ref, model), opts):
                    lm_loss(m(tokens), tokens).backward()
                    opt.step()
                    opt.zero_grad()
            full = hsdp.full_state_dict(model)
            out[f"{strategy}/{int(overlap)}"] = max(
                ((full[k] - v.cpu()).norm() / v.norm().clamp_min(1e-12)).item()
                for k, v in ref.state_dict().items())
    return out


def trace(strategy: str, mesh=None) -> dict:
    """Which stream runs what, the overlap, and who waits on whom, from one profiled step.
    Without ``mesh``: a fake 2x4 world with emulated collectives and a slow (10 GB/s) outer
    link, so that outer(i) is still running when RS(i-1) starts; with a real mesh
    (tests/gpu/test_multi_gpu.py): real NCCL."""
    dev = torch.device("cuda", torch.cuda.current_device())
    fake = mesh is None
    mesh = fake_mesh(2, 4, "cuda") if fake else mesh
    cfg = GPTConfig(vocab=512, hidden=2048, heads=16, ffn=8192, layers=6, seq=1024)
    torch.manual_seed(0)
    model = _shard(GPT(cfg).to(dev), mesh, strategy=strategy,
                   mp_policy=hsdp.MixedPrecision(torch.bfloat16, torch.float32))
    calib = emulate(model, Fabric(outer=Link(10.0)), dev) if fake else 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq), device=dev)

    def step() -> None:
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    model._hsdp_unit.tracer.enabled = True
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, acc_events=True) as prof:
        step()
        torch.cuda.synchronize()
    recs = model._hsdp_unit.tracer.take()
    model._hsdp_unit.tracer.enabled = False
    order = [(r.stream, r.label) for r in recs]  # host issue order of device-side waits
    rs_waits = [lbl for s, lbl in order if s == "rs"]
    outer_waits = [i for i, (s, lbl) in enumerate(order)
                   if s == "compute" and lbl.startswith("wait:OUTER_")]
    # Each outer reduction first makes the outer stream wait for its RS.
    outer_issued = [i for i, (s, lbl) in enumerate(order)
                    if s == "outer" and lbl.startswith("wait:RS:")]
    rank = dist.get_rank()
    out_dir = os.environ.get("HSDP_TRACE_DIR", tempfile.gettempdir())
    path = os.path.join(out_dir, f"cuda_trace_{strategy}_r{rank}.json")
    prof.export_chrome_trace(path)
    ivs = intervals_from_chrome_trace(path)
    rs = sorted((i for i in ivs if i.label.startswith("RS:")), key=lambda i: i.start_us)
    outer = sorted((i for i in ivs if i.label.startswith(("OUTER_AR", "OUTER_RS"))),
                   key=lambda i: i.start_us)
    overlaps = sum(o.start_us < n.end_us and n.start_us < o.end_us
                   for o, n in zip(outer, rs[1:]))
    m = step_metrics(ivs)
    return {"calibration_error": calib, "rs_streams": sorted({i.stream for i in rs}),
            "outer_streams": sorted({i.stream for i in outer}), "n_rs": len(rs),
            "n_outer": len(outer), "outer_overlapping_next_rs": overlaps,
            "comm_comm_overlap_ms": m["comm_comm_overlap_ms"],
            "outer_tail_ms": m["outer_tail_ms"], "trace": path,
            "rs_waits_on_outer": sum(lbl.startswith("wait:OUTER_") for lbl in rs_waits),
            "compute_waits_on_outer": len(outer_waits),
            "compute_waits_on_outer_before_last_outer_issue": sum(
                i < max(outer_issued) for i in outer_waits)}


def memory(n: int) -> dict:
    """Peak CUDA memory of n identical units on a fake 2x4 mesh."""
    mesh = fake_mesh(2, 4, "cuda")
    model = nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(n))).to(DEV)
    for layer in model:
        hsdp.fully_shard(layer, mesh=mesh)
    hsdp.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(64, 4096, device=DEV)
    for i in range(3):
        if i == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            steady = torch.cuda.memory_allocated()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return {"peak": torch.cuda.max_memory_allocated(), "steady": steady}


def intercept_wait() -> dict:
    """An emulated all-gather issued async on a side stream, coalesced (as Megatron-FSDP
    issues its all-gathers) and plain, then waited through its work handle on compute:
    ms from before the issue until compute passes the wait, with a 20 ms delay and without
    (hsdp_tools.bench.intercept)."""
    mesh = fake_mesh(2, 4, "cuda")
    group = mesh.get_group("inner")
    clock = SleepClock.calibrate(DEV)
    peer = types.SimpleNamespace(_coalescing_manager=dist._coalescing_manager)
    side = torch.cuda.Stream()
    out, inp = torch.zeros(4096, device=DEV), torch.zeros(1024, device=DEV)
    result = {}
    for delayed in (True, False):
        fabric = Fabric(Link(1000.0, 20_000.0), Link(1000.0)) if delayed else None
        for how in ("coalesced", "plain"):
            with intercept({id(group): "inner"}, Tracer(), fabric, clock, (peer,)):
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    if how == "coalesced":
                        with peer._coalescing_manager(group, async_ops=True) as work:
                            dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
                    else:
                        work = dist.all_gather_into_tensor(out, inp, group=group,
                                                           async_op=True)
                work.wait()  # on the compute stream
                end.record()
                end.synchronize()
            result[f"{how}_{'delayed' if delayed else 'free'}_ms"] = start.elapsed_time(end)
    return result


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    torch.cuda.set_device(DEV)
    try:
        result = {"world1": world1, "trace": trace, "memory": lambda n: memory(int(n)),
                  "intercept": intercept_wait}[mode](*args)
        print(json.dumps(result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
