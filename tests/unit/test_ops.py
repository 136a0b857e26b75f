"""The op table: the serialized baseline differs from the overlapped schedule by the outer
reduction's stream alone, and every op runs on the stream the table names."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import hsdp
from hsdp.streams.op_table import OUTER_REDUCTIONS, OpKind, communicator_of, op_table


def _differences(a: dict, b: dict) -> set[tuple[OpKind, str]]:
    return {(kind, f.name) for kind in OpKind for f in dataclasses.fields(a[kind])
            if getattr(a[kind], f.name) != getattr(b[kind], f.name)}


def test_serialized_baseline_differs_by_the_outer_reductions_stream_alone():
    overlapped, serialized = op_table(overlap_outer=True), op_table(overlap_outer=False)
    assert set(overlapped) == set(serialized) == set(OpKind)
    assert _differences(overlapped, serialized) == {(k, "stream") for k in OUTER_REDUCTIONS}
    for k in OUTER_REDUCTIONS:
        assert (overlapped[k].stream, serialized[k].stream) == ("outer", "rs")
        assert overlapped[k].communicator == "outer"
    # the outer all-gather (hfsdp, after the optimizer step) stays on the outer stream
    assert serialized[OpKind.OUTER_ALL_GATHER] == overlapped[OpKind.OUTER_ALL_GATHER]


def test_labels_name_their_communicator():
    table = op_table(overlap_outer=True)
    for op in table.values():
        assert communicator_of(f"{op.label}:blocks.0/0") == op.communicator
    assert communicator_of("drain") is None


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_ops_run_on_the_stream_the_table_names(fake_world_8, strategy):
    """A traced step in each schedule: every side-stream op whose label is the table's ran
    on a stream the table gives that label, and the runtime's own lookup agrees."""
    mesh = hsdp.init_mesh(2, 4, "cpu")
    for overlap in (True, False):
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 2))
        for layer in (net[0], net[2]):
            hsdp.fully_shard(layer, mesh=mesh, strategy=strategy, overlap_outer=overlap)
        hsdp.fully_shard(net, mesh=mesh, strategy=strategy, overlap_outer=overlap)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        unit = net._hsdp_unit
        for traced in (False, True):  # the second step: zero_grad's frees included
            unit.tracer.enabled = traced
            net(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            net(torch.randn(4, 8)).sum().backward()
            unit.runtime.synchronize()
        unit.tracer.enabled = False
        recs = [r for r in unit.tracer.take() if r.stream != "compute"]
        table = op_table(overlap)
        streams: dict[str, set[str]] = {}
        for op in table.values():
            streams.setdefault(op.label, set()).add(op.stream)
        seen = set()
        for r in recs:
            prefix = r.label.split(":", 1)[0]
            if prefix in streams:
                assert r.stream in streams[prefix], (overlap, r)
                seen.add(prefix)
        outer = table[OpKind.OUTER_REDUCE_SCATTER if strategy == "hfsdp"
                      else OpKind.OUTER_ALL_REDUCE]
        assert {"AG", "RS", "FREE", "FREE_GRAD", outer.label} <= seen
        for kind in OpKind:
            assert unit.runtime.stream_of(kind).name == table[kind].stream
