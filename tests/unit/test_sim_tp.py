"""hsdp_tools.sim.tp_pricing: the TP collectives of torch's Llama plan per layer (a hand count) and
their price on the compute stream."""

from __future__ import annotations

import pytest

from hsdp_tools.models import LlamaConfig, preset
from hsdp_tools.sim.costs import CostModel
from hsdp_tools.sim.engine import Setup, record
from hsdp_tools.sim.fabric import Link
from hsdp_tools.sim.tp_pricing import tp_pricer, unit_collectives


def test_tp_bytes_per_layer_70b():
    """llama-70b, seq 8192, one sequence, bf16: one activation is 8192 x 8192 x 2 bytes =
    128 MiB; per layer forward 2 all-gathers + 2 reduce-scatters of it, backward 2
    all-gathers and 5 all-reduces of it (the colwise inputs' gradients) plus the two norm
    weights' gradients (8192 x 2 bytes each)."""
    model = preset("llama-70b")
    colls = unit_collectives(model, 1, 2)
    act = 128 << 20
    assert model.seq * model.hidden * 2 == act

    def total(cls: str, kind: str) -> int:
        return sum(n for k, n in colls[cls] if k == kind)

    assert total("FWD:LlamaBlock", "all_gather") == 2 * act
    assert total("FWD:LlamaBlock", "reduce_scatter") == 2 * act
    assert colls["RECOMPUTE:LlamaBlock"] == colls["FWD:LlamaBlock"]
    assert total("BWD:LlamaBlock", "all_gather") == 2 * act
    assert total("BWD:LlamaBlock", "reduce_scatter") == 0
    assert total("BWD:LlamaBlock", "all_reduce") == 5 * act + 2 * 16384
    assert total("FWD:Linear", "all_gather") == act + 128256 * 8192 * 2  # input, logits


def test_tp_priced_on_compute():
    """The measured step's compute time in the units' phases: 1/tp of the data-parallel
    program's plus every TP collective (tp 2 on a 1 GB/s link without latency: an
    all-gather / reduce-scatter of B bytes takes B / 2 ns, an all-reduce B ns)."""
    cfg = LlamaConfig()  # 3 layers, hidden 32, vocab 37, seq 8
    rec = record(Setup(cfg, 2, 2, dtype="fp32"))
    base = CostModel().pricer(rec.program)
    priced = tp_pricer(base, rec.program, cfg, 1, 4, 2, Link(1.0, 0.0))
    ops = [op for op in rec.program.ops[rec.start:] if op.kind == "compute" and op.phase >= 0]
    act, norm, logits = 8 * 32 * 4, 32 * 4, 8 * 37 * 4
    hand = (cfg.layers * (4 * act / 2 + 2 * act / 2 + 5 * act + 2 * norm)  # blocks
            + act / 2 + act / 2  # embedding: RS forward, AG backward
            + (act + logits) / 2 + act / 2  # head: AG input and logits; RS
            + norm) * 1e-9  # the root's final norm weight
    got = sum(priced(op)[1] for op in ops)
    assert got == pytest.approx(sum(base(op)[1] for op in ops) / 2 + hand, rel=1e-9)
    side = next(op for op in rec.program.ops[rec.start:] if op.kind == "side" and op.payload)
    kind, axis, nbytes, group = side.payload[0]
    assert nbytes % 2 == 0
    halved = CostModel().fabric.seconds(kind, axis, nbytes // 2, group)
    assert priced(side)[1] == pytest.approx(
        base(side)[1] - CostModel().fabric.seconds(kind, axis, nbytes, group) + halved
        - side.local_bytes / 3000e9 + side.local_bytes // 2 / 3000e9, rel=1e-6)
