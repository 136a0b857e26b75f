"""One-GPU smoke run: real NCCL at world size 1, then a fake 2x4 mesh with emulated
collectives under the profiler. Writes a Chrome trace to $OUT (or /tmp)."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import hsdp
from hsdp.bench.emulate import emulate, fake_mesh
from hsdp.bench.model import GPT, GPTConfig, lm_loss
from hsdp.fabric import Fabric

out = os.environ.get("OUT", "/tmp")
mode = sys.argv[1]
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)

if mode == "real1":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl")
    mesh = hsdp.init_mesh(1, 1, "cuda")
else:
    mesh = fake_mesh(2, 4, "cuda")

cfg = GPTConfig(vocab=1000, hidden=1024, heads=16, ffn=4096, layers=8, seq=512)
torch.manual_seed(0)
ref = GPT(cfg).cuda()
torch.manual_seed(0)
model = GPT(cfg).cuda()
for strategy in ["hsdp", "hfsdp"] if mode != "real1" else ["hsdp"]:
    pass
strategy = os.environ.get("STRATEGY", "hsdp")
overlap = os.environ.get("OVERLAP", "1") == "1"
for b in model.blocks:
    hsdp.fully_shard(b, mesh=mesh, strategy=strategy, overlap_outer=overlap,
                     mp_policy=hsdp.MixedPrecision(torch.bfloat16, torch.float32))
hsdp.fully_shard(model, mesh=mesh, strategy=strategy, overlap_outer=overlap,
                 mp_policy=hsdp.MixedPrecision(torch.bfloat16, torch.float32))
if mode == "fake":
    err = emulate(model, Fabric(), dev)
    print("sleep calibration error", err)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
tokens = torch.randint(0, cfg.vocab, (4, cfg.seq), device=dev)


def step():
    loss = lm_loss(model(tokens), tokens)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


for _ in range(3):
    step()
torch.cuda.synchronize()
times = []
for _ in range(10):
    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times.append((time.perf_counter() - t) * 1e3)
print(mode, strategy, "overlap" if overlap else "serial", "step ms median",
      sorted(times)[len(times) // 2], "min", min(times), "max", max(times))
print("peak mem GiB", torch.cuda.max_memory_allocated() / 2**30)
model._hsdp_unit.tracer.enabled = True
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
path = os.path.join(out, f"trace_{mode}_{strategy}_{int(overlap)}.json")
prof.export_chrome_trace(path)
tr = json.load(open(path))
streams = {}
for e in tr["traceEvents"]:
    if e.get("cat") == "kernel":
        streams.setdefault(e["args"].get("stream"), set()).add(e["name"][:40])
for s, names in streams.items():
    print("stream", s, sorted(names)[:6])
if mode == "real1":
    sd = hsdp.full_state_dict(model)
    print("state dict ok", len(sd))
dist.destroy_process_group()
