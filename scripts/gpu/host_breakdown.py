"""Host time per step inside hsdp's hooks and side-op submits, on one GPU: the
collective-free emulated 16x8 step (seq from argv), hsdp overlap, each runtime method
below timed by a wrapper (outermost call only per method), ms per step and us per call
over 10 steps after 3 warm-up ones; then the step's host time by phase (forward,
backward, optimizer).

    PYTHONPATH=src python3 scripts/gpu/host_breakdown.py 1024
"""
import collections
import functools
import statistics
import sys
import time

import torch
from emulated_16x8 import setup

from hsdp import comm, group, schedule, streams
from hsdp.bench.trainee import build

TIMED = {
    schedule.Runtime: ["_pre_forward", "_post_forward", "_pre_backward", "_post_backward",
                       "_finalize", "_begin_forward", "_unshard", "_prefetch",
                       "_attach_post_backward", "_register_pre_backward", "_reduce",
                       "_reshard", "_agree", "_before_optimizer_step",
                       "_after_optimizer_step"],
    group.ParamGroup: ["_on_grad", "copy_in", "unshard", "reduce_scatter", "outer_reduce",
                       "use_unsharded", "use_sharded", "expose_grads"],
    comm.Collectives: ["all_gather", "reduce_scatter", "all_reduce"],
    streams.CudaSideStream: ["submit"],
    streams.CudaCompute: ["record", "wait"],
}
total: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(cls: type, name: str) -> None:
    f, key, active = getattr(cls, name), f"{cls.__name__}.{name}", [0]

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        if active[0]:
            return f(*args, **kwargs)
        active[0] += 1
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            total[key] += time.perf_counter() - t0
            calls[key] += 1
            active[0] -= 1
    setattr(cls, name, wrapper)


cfg, dev, mesh, b = setup(sys.argv[1])
t = build("overlap", cfg.model, cfg.mp, mesh, dev, cfg.fabric, True)
for _ in range(3):
    t.step(b, delays=False)
for cls, names in TIMED.items():
    for name in names:
        timed(cls, name)
phases, hosts, n = collections.defaultdict(list), [], 10
for _ in range(n):
    last = [time.perf_counter()]

    def mark(phase: str, last: list = last) -> None:
        now = time.perf_counter()
        phases[phase].append((now - last[0]) * 1e3)
        last[0] = now

    torch.cuda.synchronize()
    hosts.append(t.step(b, delays=False, mark=mark) * 1e3)
print(f"host {statistics.median(hosts):.1f} ms per step; by phase",
      {k: round(statistics.median(v), 2) for k, v in phases.items()})
for key, s in total.most_common():
    print(f"{key:40s} {s / n * 1e3:7.3f} ms/step {calls[key] / n:6.1f} calls/step "
          f"{s / calls[key] * 1e6:8.1f} us/call")
