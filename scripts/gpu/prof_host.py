"""Host profile of the collective-free emulated step on one GPU (16x8, seq from argv):
hsdp overlap and the unsharded reference, per-phase host ms, then cProfile of 10 steps
each (by own time, and hsdp's functions by cumulative time).

    PYTHONPATH=src python3 scripts/gpu/prof_host.py 1024
"""
import collections
import cProfile
import io
import pstats
import sys
import time

import torch
from emulated_16x8 import setup

from hsdp.bench.trainee import build, build_unsharded

cfg, dev, mesh, b = setup(sys.argv[1])
trainees = {"overlap": build("overlap", cfg.model, cfg.mp, mesh, dev, cfg.fabric, True),
            "ref": build_unsharded(cfg.model, cfg.mp, cfg.inner, dev)}
for t in trainees.values():
    for _ in range(3):
        t.step(b, delays=False)
for name, t in trainees.items():
    steps, hosts, phases = [], [], collections.defaultdict(list)
    for _ in range(10):
        last = [time.perf_counter()]

        def mark(phase: str, last: list = last, phases: dict = phases) -> None:
            now = time.perf_counter()
            phases[phase].append((now - last[0]) * 1e3)
            last[0] = now

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hosts.append(t.step(b, delays=False, mark=mark))
        steps.append(time.perf_counter() - t0)
    print(f"{name}: step {sorted(steps)[5] * 1e3:.1f} ms host {sorted(hosts)[5] * 1e3:.1f} ms "
          f"phases", {k: round(sorted(v)[5], 2) for k, v in phases.items()})
for name, t in trainees.items():
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        t.step(b, delays=False)
    prof.disable()
    for key, pattern in (("tottime", ""), ("cumulative", r"hsdp/(?!models\.py|bench/)")):
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats(key)
        stats.print_stats(pattern, 45) if pattern else stats.print_stats(45)
        text = out.getvalue()
        print(f"==== cProfile {name} (10 steps) by {key} {pattern}")
        print(text[text.find("   ncalls"):])
