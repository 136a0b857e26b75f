"""The schedule itself, observed on CPU: a fake 2x4 world whose collectives are emulated
by host sleeps on hsdp's stream threads (inner 100 ms, outer 60 ms per collective: long
enough for a loaded host), so that the order and overlap of operations can be read off
the streams' records."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hsdp
from hsdp.streams.contract import OpRecord
from hsdp_tools.bench.emulate import emulate
from hsdp_tools.sim.fabric import Fabric, Link

UNITS = 4
FABRIC = Fabric(Link(1e6, 100_000.0), Link(1e6, 60_000.0))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(UNITS))
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def _traced_step(strategy: str, overlap: bool) -> tuple[list[OpRecord], list[str]]:
    mesh = hsdp.init_mesh(2, 4, "cpu")
    net = Net()
    for layer in net.layers:
        hsdp.fully_shard(layer, mesh=mesh, strategy=strategy, overlap_outer=overlap)
    hsdp.fully_shard(net, mesh=mesh, strategy=strategy, overlap_outer=overlap)
    emulate(net, FABRIC, torch.device("cpu"))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    unit_labels = [layer._hsdp_unit.label for layer in net.layers]
    for traced in (False, True):
        net._hsdp_unit.tracer.enabled = traced
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        net._hsdp_unit.runtime.synchronize()
    return net._hsdp_unit.tracer.take(), unit_labels


def _ops(recs: list[OpRecord], prefix: str) -> list[OpRecord]:
    return sorted((r for r in recs if r.label.startswith(prefix)), key=lambda r: r.start_s)


def _unit(rec: OpRecord) -> str:
    return rec.label.split(":", 1)[1].split("/")[0]


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_outer_overlaps_next_reduce_scatter_on_its_own_stream(fake_world_8, strategy):
    recs, units = _traced_step(strategy, overlap=True)
    kind = "OUTER_AR" if strategy == "hsdp" else "OUTER_RS"
    rs, outer = _ops(recs, "RS:"), _ops(recs, kind)
    assert {r.stream for r in outer} == {"outer"} and {r.stream for r in rs} == {"rs"}
    # Same unit order for RS and outer (every rank issues them in this order).
    assert [_unit(r) for r in rs] == [_unit(r) for r in outer]
    assert [_unit(r) for r in rs if _unit(r) in units] == units[::-1]
    overlapped = sum(o.start_s < nxt.end_s and nxt.start_s < o.end_s
                     for o, nxt in zip(outer, rs[1:]))
    assert overlapped == len(rs) - 1, "outer(i) should overlap RS(i-1)"
    # Compute blocks on the outer stream only at the end-of-backward finalize, i.e. once
    # every reduce-scatter has finished.
    last_rs_end = max(r.end_s for r in rs)
    waits = [r for r in recs if r.stream == "compute" and r.label.startswith("wait:OUTER")]
    assert all(w.start_s >= last_rs_end - 1e-4 for w in waits)


def test_serialized_baseline_runs_outer_on_the_rs_stream(fake_world_8):
    recs, _ = _traced_step("hsdp", overlap=False)
    rs, outer = _ops(recs, "RS:"), _ops(recs, "OUTER_AR")
    assert {r.stream for r in outer} == {"rs"}
    for o, nxt in zip(outer, rs[1:]):
        assert nxt.start_s >= o.end_s - 1e-4, "serialized: RS(i-1) waits for outer(i)"


def test_prefetch_order_on_the_all_gather_stream(fake_world_8):
    recs, units = _traced_step("hsdp", overlap=True)
    ag = [f"{r.label.split(':')[0]}:{_unit(r)}" for r in recs
          if r.stream == "ag" and r.label != "drain"]  # FIFO: record order = issue order

    def first(op: str) -> int:
        return ag.index(op)

    def last(op: str) -> int:
        return len(ag) - 1 - ag[::-1].index(op)

    # Forward: AG(i+1) is issued before unit i's gathered buffer is released.
    for a, b in zip(units, units[1:]):
        assert first(f"AG:{b}") < first(f"FREE:{a}")
    # Backward: AG(i-1) is issued before unit i's buffer is released after its backward.
    for a, b in zip(units[::-1], units[::-1][1:]):
        assert last(f"AG:{b}") < last(f"FREE:{a}")
    # The last unit of the forward is resharded (reshard_after_forward=True, as FSDP2) and
    # gathered again by the root's backward prefetch, before the root's buffer is freed.
    assert ag.count(f"AG:{units[-1]}") == 2 and ag.count(f"FREE:{units[-1]}") == 2


def test_hfsdp_outer_all_gather_runs_after_the_step_before_forward(fake_world_8):
    recs, units = _traced_step("hfsdp", overlap=True)
    outer_ag = _ops(recs, "OUTER_AG")
    # One per trainable group, issued by optimizer.step() in unit order, on the outer stream.
    assert outer_ag and {r.stream for r in outer_ag} == {"outer"}
    last_rs = max(r.end_s for r in _ops(recs, "OUTER_RS"))
    assert all(r.start_s >= last_rs - 1e-4 for r in outer_ag)
