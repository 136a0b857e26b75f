"""Memory does not grow with depth beyond the sharded state.

Each case runs in a fresh process (all at once) posing as rank 0 of a fake 2x4 world and reads the
process's peak resident memory (VmHWM, reset after set-up) over two training steps.
MALLOC_MMAP_THRESHOLD_ makes freed buffers go back to the OS at once, so the peak
follows live memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

WIDTH = 1024  # one unit: a 1024x1024 fp32 Linear = 4 MiB unsharded

CHILD = r"""
import json, re, sys, torch, torch.nn as nn, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import hsdp
torch.set_num_threads(1)
n, strategy, width = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
mesh = hsdp.init_mesh(2, 4, "cpu")
def hwm():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
model = nn.Sequential()
for _ in range(n):
    layer = nn.Linear(width, width, bias=False)
    model.append(hsdp.fully_shard(layer, mesh=mesh, strategy=strategy))
hsdp.fully_shard(model, mesh=mesh, strategy=strategy)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
live = {"max": 0}
def sample(*_):
    live["max"] = max(live["max"], sum(
        g.buffers.gathered.untyped_storage().nbytes() > 0 for m in model for g in m._hsdp_unit.groups))
rs_inputs = {"max": 0}  # other units' RS inputs alive when a unit's is allocated
for m in model:
    for g in m._hsdp_unit.groups:
        def copy_in(orig=g.grads.copy_in):
            pending = model._hsdp_unit.runtime.step.pending_rs
            rs_inputs["max"] = max(rs_inputs["max"], sum(p[1].numel() for p in pending))
            return orig()
        g.grads.copy_in = copy_in
    m.register_forward_hook(sample)
    m.register_full_backward_hook(sample)
x = torch.randn(8, width)
def step():
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
step()  # optimizer state exists from here on
model._hsdp_unit.runtime.synchronize()
open("/proc/self/clear_refs", "w").write("5")
base = hwm()
for _ in range(2):
    step()
model._hsdp_unit.runtime.synchronize()
print(json.dumps({"peak": hwm(), "base": base, "max_gathered_units": live["max"],
                  "rs_inputs_at_copy_in": rs_inputs["max"]}))
dist.destroy_process_group()
"""


STRATEGIES, DEPTHS = ("hsdp", "hfsdp"), (8, 16)


def _run(n: int, strategy: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), strategy, str(WIDTH)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs() -> dict[tuple[int, str], dict]:
    """Every case's process at the same time (each measures only itself; CI has two
    cores): (depth, strategy) -> its measurements."""
    cases = [(n, s) for s in STRATEGIES for n in DEPTHS]
    with ThreadPoolExecutor(len(cases)) as pool:
        return dict(zip(cases, pool.map(lambda case: _run(*case), cases)))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux procfs")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_peak_memory_grows_only_by_sharded_state(strategy: str, runs: dict) -> None:
    small, big = runs[DEPTHS[0], strategy], runs[DEPTHS[1], strategy]
    unit = WIDTH * WIDTH * 4  # bytes of one unsharded unit
    # Sharded state per unit, 2x4 mesh. hsdp: main weights, grad accumulation and SGD
    # momentum, 1/4 each. hfsdp: inner param shard and grad accumulation (1/4 each), outer
    # grad shard and momentum (1/8 each); main weights are a window of the param shard.
    sharded = unit * (3 / 4 if strategy == "hsdp" else 1 / 4 + 1 / 4 + 1 / 8 + 1 / 8)
    growth = big["peak"] - small["peak"]
    assert growth <= 8 * sharded + unit, (growth, small, big)
    # Transient memory (gathered params, unsharded grads, RS inputs) does not scale with
    # depth: the peak above the steady state is about the same for 8 and 16 units.
    assert abs((big["peak"] - big["base"]) - (small["peak"] - small["base"])) <= 2 * unit
    # Double buffering: the unit in use plus one prefetched (plus the root).
    assert small["max_gathered_units"] <= 3 and big["max_gathered_units"] <= 3
    # One unit's RS input at a time (as FSDP2): the previous unit's is released before the
    # next copy-in allocates its own.
    assert small["rs_inputs_at_copy_in"] == big["rs_inputs_at_copy_in"] == 0
