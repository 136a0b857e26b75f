"""hsdp_tools.sim with hfsdp's compressed outer parameter all-gather (``outer_gather``): the
recorded op and its bytes, the sweep key."""

from __future__ import annotations

import pytest

from hsdp_tools.models import LlamaConfig
from hsdp_tools.sim.costs import CostModel
from hsdp_tools.sim.engine import Setup, evaluate, record
from hsdp_tools.sim.sweep import parse_sweep, run_sweep

TINY_LLAMA = LlamaConfig(vocab=32, hidden=16, heads=4, kv_heads=2, ffn=24, layers=3, seq=8)


def _outer_gathers(rec) -> tuple[list[str], int]:
    """The measured step's outer all-gather ops (their labels' prefix) and bytes (the
    warm-up step before it: the compressed gather's first forward gathers once more)."""
    labels, nbytes = [], 0
    for op in rec.program.ops[rec.start:]:
        if op.kind == "side" and op.label.startswith(("OUTER_AG:", "OUTER_QAG:")):
            labels.append(op.label.split(":")[0])
            nbytes += sum(n for kind, axis, n, _ in op.payload if axis == "outer")
    return labels, nbytes


def test_compressed_outer_gather_is_priced_by_its_bytes(fake_world_8):
    """outer_gather="int8": hfsdp's outer all-gather of bf16 weights becomes OUTER_QAG, one
    byte per weight plus a scale per block: about half the bytes, and fewer outer bytes per
    step (the reduce-scatter's are unchanged)."""
    recs = {g: record(Setup(TINY_LLAMA, 2, 4, "hfsdp", reduce_dtype="bf16", outer_gather=g))
            for g in ("none", "int8:64")}
    (exact_ops, exact), (q_ops, compressed) = (_outer_gathers(recs[g])
                                               for g in ("none", "int8:64"))
    assert set(exact_ops) == {"OUTER_AG"} and set(q_ops) == {"OUTER_QAG"}
    assert len(exact_ops) == len(q_ops)
    assert 0.5 <= compressed / exact < 0.6  # 1 + 4/64 bytes of 2; padding on top
    per_step = {g: evaluate(r, CostModel()).metrics["outer_bytes_per_step"]
                for g, r in recs.items()}
    assert per_step["none"] - per_step["int8:64"] == exact - compressed


def test_outer_gather_needs_hfsdp():
    with pytest.raises(ValueError, match="outer_gather='int8' needs strategy 'hfsdp'"):
        Setup(TINY_LLAMA, 2, 4, "hsdp", outer_gather="int8")
    with pytest.raises(ValueError, match="block=12"):
        Setup(TINY_LLAMA, 2, 4, "hfsdp", outer_gather="int8:12")


def test_sweep_skips_hsdp_with_a_compressed_gather(fake_world_8):
    grid = parse_sweep(["strategy=hsdp,hfsdp", "outer_gather=none,int8:64"])
    report = run_sweep(Setup(TINY_LLAMA, 2, 4), CostModel(), grid, progress=lambda _: None)
    points = [(r["strategy"], r["outer_gather"]) for r in report["rows"]]
    assert sorted(points) == [("hfsdp", "int8:64"), ("hfsdp", "none"), ("hsdp", "none")]


def test_quantization_passes_are_priced_as_the_fused_kernels(fake_world_8):
    """The compressed outer reduction and gather record their fused passes (one read of
    each input, one write of each output; ``sim/quant_pricing.py``) instead of the eager
    ops' many passes, priced per pass by the profile's ``quant_x_floor``."""
    rec = record(Setup(TINY_LLAMA, 2, 4, "hfsdp", reduce_dtype="bf16", outer_reduce="int8",
                       outer_gather="int8"))
    hs = record(Setup(TINY_LLAMA, 2, 4, "hsdp", reduce_dtype="bf16", outer_reduce="int8"))
    passes = {}
    for r in (rec, hs):
        for op in r.program.ops[r.start:]:
            if op.kind == "side" and op.label.split(":")[0].startswith("OUTER_Q"):
                passes.setdefault(op.label.split(":")[0], set()).update(
                    k for k, _ in op.kernel_bytes)
    assert passes == {"OUTER_QRS": {"encode", "reduce"}, "OUTER_QAG": {"encode", "decode"},
                      "OUTER_QAR": {"encode", "requant", "decode"}}
    fast, slow = (evaluate(hs, CostModel(quant_x_floor=dict.fromkeys(
        ("encode", "requant", "decode"), x))).t_step_ms for x in (1.0, 1e5))
    assert slow > fast
