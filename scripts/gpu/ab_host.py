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

from hsdp.bench import step as S
from hsdp.bench.emulate import fake_mesh
from hsdp.bench.trainee import build, synthetic_batches

mine = argparse.ArgumentParser()
mine.add_argument("version")
mine.add_argument("--seq", default="1024")
ab = mine.parse_args()
p = argparse.ArgumentParser()
S.add_arguments(p)
args = p.parse_args(["--emulate", "--mesh", "16x8", "--seq", ab.seq, "--reduce-dtype", "bf16"])
cfg = S.resolve(args, True, None)
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
mesh = fake_mesh(16, 8, "cuda")
b = synthetic_batches(cfg.model.vocab, cfg.mbs, cfg.model.seq, 1, dev)
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
