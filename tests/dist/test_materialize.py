"""Meta-device init: fully_shard on the meta device, then hsdp.materialize.

Values: rank 0 of a fake 2x4 world (materialize needs no communication on a first visit)
holds exactly its pieces of the model initialized normally under the same seed. Memory:
a fresh process's peak resident memory during materialize (as in test_memory.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hsdp
from hsdp_tools.models import GPT, GPTConfig
from hsdp.sharding.group import owner


def init_fn(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            m.bias.data.uniform_(-0.1, 0.1)  # through .data: a write all the same
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight)
    elif isinstance(m, nn.LayerNorm):
        m.weight = nn.Parameter(torch.full_like(m.weight, 1.5))  # replaced, not in place
        nn.init.zeros_(m.bias)
    elif isinstance(m, GPT):
        with torch.no_grad():
            m.pos.normal_(std=0.02)
            m.logit_scale.fill_(1.0)


def _check_pieces(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), (rname, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == rname
        g, idx = owner(p)
        start = g.params[idx].start
        piece = g.params[idx].local  # this rank's piece of the flattened parameter
        want = r.detach().reshape(-1)[start:start + piece.numel()]
        assert piece.device.type == "cpu" and torch.equal(piece, want), name


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_values_equal_a_normal_init(fake_world_8, strategy):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    cfg = GPTConfig()
    ref = GPT(cfg)
    torch.manual_seed(7)
    for m in ref.modules():
        init_fn(m)
    with torch.device("meta"):
        model = GPT(cfg)
    mp = hsdp.MixedPrecision(torch.bfloat16)  # init runs in the parameters' own dtype
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, strategy=strategy, mp_policy=mp)
    hsdp.fully_shard(model, mesh=mesh, strategy=strategy, mp_policy=mp)
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match="hsdp.materialize"):
        model(torch.zeros(2, cfg.seq, dtype=torch.long))
    torch.manual_seed(7)
    hsdp.materialize(model, init_fn)
    _check_pieces(model, ref)
    model(torch.zeros(2, cfg.seq, dtype=torch.long)).sum().backward()


def test_init_calls_and_what_init_fn_sees(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                              nn.Linear(8, 2))
        model[1].register_buffer("scale", torch.empty(8))
    hsdp.fully_shard(model[1], mesh=mesh)
    hsdp.fully_shard(model, mesh=mesh)
    seen = []

    def record(m: nn.Module) -> None:
        seen.append((type(m).__name__, {n: tuple(p.shape) for n, p in
                                        m.named_parameters(recurse=False)}))
        if isinstance(m, nn.Linear):
            m.reset_parameters()
        if "scale" in m._buffers:
            m.scale.fill_(2.0)

    hsdp.materialize(model, record)
    assert seen == [("HSDPSequential", {}), ("Linear", {"weight": (8, 4), "bias": (8,)}),
                    ("HSDPSequential", {}), ("Linear", {"weight": (8, 8), "bias": (8,)}),
                    ("ReLU", {}), ("Linear", {"weight": (2, 8), "bias": (2,)})]
    assert torch.equal(model[1].scale, torch.full((8,), 2.0))


def test_uninitialized_tensors_are_reported(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    hsdp.fully_shard(model, mesh=mesh)
    with pytest.raises(RuntimeError, match=r"uninitialized: 1\.weight, 1\.bias"):
        hsdp.materialize(model, lambda m: isinstance(m, nn.Linear) and m.reset_parameters())
    with torch.device("meta"):
        mixed = nn.Sequential(nn.Linear(4, 8))
    mixed.append(nn.Linear(8, 2))
    with pytest.raises(RuntimeError, match="on the meta device and some are not"):
        hsdp.fully_shard(mixed, mesh=mesh)


def test_meta_buffer_needs_materialize(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    model = nn.Linear(4, 4)
    model.register_buffer("shift", torch.empty(4, device="meta"))
    hsdp.fully_shard(model, mesh=mesh)
    with pytest.raises(RuntimeError, match="hsdp.materialize"):
        model(torch.randn(2, 4))


CHILD = r"""
import json, re, sys, torch, torch.nn as nn, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import hsdp
torch.set_num_threads(1)
dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
mesh = hsdp.init_mesh(2, 4, "cpu")
def hwm():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
width, units = int(sys.argv[1]), int(sys.argv[2])
with torch.device("meta"):
    model = nn.Sequential(nn.Embedding(width // 4, width),
                          *[nn.Linear(width, width, bias=False) for _ in range(units)])
for layer in model[1:]:
    hsdp.fully_shard(layer, mesh=mesh)
hsdp.fully_shard(model, mesh=mesh)
open("/proc/self/clear_refs", "w").write("5")
base = hwm()
hsdp.materialize(model, lambda m: [nn.init.normal_(p) for p in m.parameters(recurse=False)])
print(json.dumps({"peak": hwm() - base}))
dist.destroy_process_group()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux procfs")
def test_materialize_holds_the_root_and_one_unit_in_full():
    width, units = 1024, 6
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    out = subprocess.run([sys.executable, "-c", CHILD, str(width), str(units)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    peak = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    unit = width * width * 4  # one unit in full (fp32)
    root = unit // 4
    shards = (units * unit + root) // 4  # hsdp on 2x4: each rank keeps a quarter
    # Root + one unit in full, the shards, and 2 MiB of slack; a whole model in full
    # would be 6 units more.
    assert peak <= root + unit + shards + (2 << 20), (peak, root, unit, shards)
