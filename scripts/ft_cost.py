"""Step time with fault tolerance on or off (issue 28's cost), one GPU, one process.

    PYTHONPATH=src python scripts/ft_cost.py --ft on --seq 4096 --out out/ft_on_4096.json

One replica group of one rank. ``--ft on``: the lighthouse runs in this process and the
mesh is ``init_mesh(1, 1, fault_tolerance=...)``: each step starts with torchft's quorum,
the outer all-reduce goes through torchft's managed group (of one replica) on hsdp's outer
stream (NCCL: on its current communicator, under one ``CollectiveWatchdog`` instead of
torchft's timers per collective), and ``should_commit()`` gates the optimizer step.
``--ft off``: plain hsdp on a (1, 1) mesh (no outer reduction at all), so the difference
is everything fault tolerance adds to a step. Timing: CUDA-synchronized wall time per
step after a warm-up; the JSON holds the median, min and max in ms; with ``--phases``,
also the median per phase (``phases``, ms per step, host time, each call wrapped in a
timer):
``start_quorum`` (the call), ``quorum`` (from that call until torchft has the quorum, on
its thread), ``quorum_wait`` / ``quorum_late`` (the waits for it that found it ready /
that blocked because it was not), ``forward``, ``backward`` (host time of each call),
``managed_all_reduce`` (all the step's outer all-reduces through torchft, on hsdp's outer
stream), ``should_commit``, ``optimizer``. ``--device cpu`` (gloo) with ``--hidden``
shrinks the model (heads of 64, ffn 4 x hidden) to find where the host time goes.
``--optimizer``: torch AdamW foreach (default) or fused (torchtitan's default). Why it
matters here: ``should_commit()`` synchronizes the device, so with fault tolerance on the
GPU idles while the host launches the optimizer step, which plain hsdp hides behind the
backward still running on the GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hsdp
from hsdp.topology.communicators import comm_groups
from hsdp_tools.models import build_model, lm_loss, preset, shard_units


class Phases:
    """Host time per phase of the current step (ms), summed over the calls of the step and
    over threads (the outer all-reduce runs on hsdp's outer stream)."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._lock = threading.Lock()

    def add(self, name: str, ms: float) -> None:
        with self._lock:
            self.step[name] += ms

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, its time added to phase ``name``."""
        @functools.wraps(fn)
        def run(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, (time.perf_counter() - start) * 1e3)
        return run

    def next_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(dict(self.step))
        self.step = defaultdict(float)

    def medians(self) -> dict[str, float]:
        names = sorted({n for s in self.steps for n in s})
        return {n: statistics.median(s.get(n, 0.0) for s in self.steps) for n in names}


def instrument(manager: Any, mesh: Any, phases: Phases) -> None:
    """Time torchft's calls of a step: its quorum (until the future is done, on torchft's
    thread), every blocking wait for it, the managed all-reduces and ``should_commit``."""
    def start_quorum(*a: Any, **k: Any) -> None:
        start = time.perf_counter()
        start_call(*a, **k)
        phases.add("start_quorum", (time.perf_counter() - start) * 1e3)
        manager._quorum_future.add_done_callback(
            lambda _: phases.add("quorum", (time.perf_counter() - start) * 1e3))
    start_call = manager.start_quorum
    manager.start_quorum = start_quorum
    # calls that found the quorum ready (their own cost), and those that blocked on it
    waits = {True: phases.timed("quorum_wait", manager.wait_quorum),
             False: phases.timed("quorum_late", manager.wait_quorum)}
    manager.wait_quorum = lambda: waits[manager._quorum_future.done()]()
    manager.should_commit = phases.timed("should_commit", manager.should_commit)
    elastic = comm_groups(mesh).elastic
    elastic.all_reduce = phases.timed("managed_all_reduce", elastic.all_reduce)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--ft", choices=("on", "off"), required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", "--json", dest="out", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo, for the per-phase host times (not GPU step times)")
    p.add_argument("--phases", action="store_true",
                   help="time the step's phases (wraps each call in a timer)")
    p.add_argument("--optimizer", choices=("foreach", "fused"), default="foreach",
                   help="torch AdamW's implementation (torchtitan's default is fused)")
    p.add_argument("--hidden", type=int, default=None,
                   help="a smaller model: hidden size (heads of 64, ffn 4 x hidden)")
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
    small = {} if args.hidden is None else dict(hidden=args.hidden, heads=args.hidden // 64,
                                                 ffn=4 * args.hidden)
    cfg = preset("gpt-1b", layers=args.layers, seq=args.seq, **small)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = build_model(cfg)
    mp = hsdp.MixedPrecision(param_dtype=torch.bfloat16 if cuda else None,
                             reduce_dtype=torch.float32)
    for unit, reshard in shard_units(model):
        hsdp.fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    hsdp.fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                            **{args.optimizer: True})
    manager = hsdp.fault_tolerance(model, opt) if ft is not None else None
    tokens = torch.randint(0, cfg.vocab, (1, args.seq), device=args.device,
                           generator=torch.Generator(args.device).manual_seed(1))
    phases = Phases()
    forward, backward, optimizer = model, torch.Tensor.backward, opt.step
    if args.phases:
        if manager is not None:
            instrument(manager, mesh, phases)
        forward = phases.timed("forward", forward)
        backward = phases.timed("backward", backward)
        optimizer = phases.timed("optimizer", optimizer)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        if manager is not None:
            manager.start_quorum()
        backward(lm_loss(forward(tokens), tokens))
        if manager is None or manager.should_commit():
            optimizer()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
        phases.next_step(keep=i >= args.warmup)
    hsdp.synchronize(model)
    result = {"ft": args.ft, "seq": args.seq, "layers": args.layers, "model": "gpt-1b",
              "optimizer": args.optimizer,
              "steps": args.steps, "median_ms": statistics.median(times),
              "min_ms": min(times), "max_ms": max(times), "phases": phases.medians(),
              "hidden": cfg.hidden, "torch": torch.__version__,
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
