"""hsdp overlap's step and host time on one GPU (emulated 16x8, seq 1024 or --seq): one
JSON line.

A/B of code versions, each in its own process (docs/benchmarks.md sections 12 and 13):

    for v in old new; do git archive <rev> src | tar -x -C v_$v; done
    for r in 1 2; do for v in old new; do
        PYTHONPATH=v_$v/src python3 scripts/gpu/ab_host.py $v [--seq 4096]; done; done
"""
import argparse
import json
import statistics
import time

import torch
from emulated_16x8 import setup

from hsdp.bench.trainee import build

mine = argparse.ArgumentParser()
mine.add_argument("version")
mine.add_argument("--seq", default="1024")
ab = mine.parse_args()
cfg, dev, mesh, b = setup(ab.seq)
t = build("overlap", cfg.model, cfg.mp, mesh, dev, cfg.fabric, True)
for _ in range(3):
    t.step(b)
st, ho = [], []
for _ in range(12):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    h = t.step(b)
    st.append(time.perf_counter() - t0)
    ho.append(h)
print(json.dumps({"v": ab.version, "seq": int(ab.seq), "step": statistics.median(st) * 1e3,
                  "host": statistics.median(ho) * 1e3, "host_min": min(ho) * 1e3}))
