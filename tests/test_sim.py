"""hsdp.sim: hand-computed tiny steps, the runtime's op order, GPT sizes, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

import hsdp
from hsdp.__main__ import main
from hsdp.fabric import Fabric, Link
from hsdp.models import GPT, GPTConfig, lm_loss
from hsdp.sim import SimConfig, UnitSpec, gpt_units, simulate, tflops_from_results

# Units of P elements on a 2x2 mesh, no latency: AG 1 ms, RS 2 ms (inner 1 GB/s);
# outer all-reduce 4 ms, hfsdp outer RS 2 ms, outer AG 1 ms (outer 0.5 GB/s).
P = 1_000_000
FABRIC = Fabric(Link(1.0, 0.0), Link(0.5, 0.0))
AG, RS, AR = 1.0, 2.0, 4.0  # ms


def config(n_units: int, fwd: float = 0.0, root_fwd: float = 0.0, **kw) -> SimConfig:
    """A root plus ``n_units - 1`` blocks of P parameters; backward = 2 x forward."""
    units = (UnitSpec("root", P, root_fwd, 2 * root_fwd),
             *(UnitSpec(f"b{i}", P, fwd, 2 * fwd) for i in range(1, n_units)))
    return SimConfig(units, outer=2, inner=2, fabric=FABRIC, **kw)


def ops(result, prefix: str) -> list:
    return [iv for iv in result.intervals if iv.label.startswith(prefix)]


def ms(us: float) -> float:
    return round(us / 1e3, 9)


def test_zero_compute_serial_is_the_sum_overlap_the_max_of_the_chains():
    over, ser = simulate(config(2)), simulate(config(2, overlap_outer=False))
    # Both AGs are exposed (2 AG), then RS(b1), RS(root) on rs and the two outer
    # all-reduces: overlapped, outer(b1) runs beside RS(root); serialized, all four queue.
    assert over.t_step_ms == pytest.approx(2 * AG + RS + max(RS, AR) + AR)
    assert ser.t_step_ms == pytest.approx(2 * AG + 2 * (RS + AR))
    assert [iv.stream for iv in ops(over, "OUTER_AR")] == ["outer", "outer"]
    assert [iv.stream for iv in ops(ser, "OUTER_AR")] == ["rs", "rs"]
    assert over.metrics["comm_comm_overlap_ms"] == pytest.approx(RS)
    assert ser.metrics["comm_comm_overlap_ms"] == 0.0


def test_compute_bound_serial_equals_overlap_up_to_the_tail():
    kw = dict(fwd=10.0, root_fwd=5.0)
    over, ser = simulate(config(4, **kw)), simulate(config(4, overlap_outer=False, **kw))
    compute_end = 2 * AG + 3 * (10 + 20) + (5 + 10)  # the first two AGs are exposed
    assert over.t_step_ms == pytest.approx(compute_end + RS + max(RS, AR) + AR)
    assert ser.t_step_ms == pytest.approx(compute_end + 2 * (RS + AR))
    for r in (over, ser):
        assert r.metrics["busy_ms"]["by_kind"]["compute"] == pytest.approx(105.0)
        assert r.metrics["exposed_comm_ms"] == pytest.approx(r.t_step_ms - 105.0)


def test_free_on_ag_holds_the_next_prefetch_until_the_forward_ends():
    r = simulate(config(4, fwd=10.0, root_fwd=5.0))
    fwd_b1 = next(iv for iv in r.intervals if iv.label == "FWD:b1")
    ag = [iv for iv in r.intervals if iv.stream == "ag"]
    labels = [iv.label for iv in ag]
    assert labels == ["AG:root", "AG:b1", "AG:b2", "FREE:b1", "AG:b3", "FREE:b2",  # forward
                      "AG:b2", "FREE:b3", "AG:b1", "FREE:b2", "FREE:b1", "FREE:root"]
    assert ag[labels.index("AG:b3")].start_us == fwd_b1.end_us  # not at AG:b2's end
    root_bwd = next(iv for iv in r.intervals if iv.label == "BWD:root")
    assert root_bwd.start_us == next(iv for iv in r.intervals
                                     if iv.label == "FWD:root").end_us  # root kept gathered


def test_hfsdp_outer_all_gather_after_the_optimizer():
    r = simulate(config(2, strategy="hfsdp", optimizer_ms=5.0))
    # RS(b1) 2-4, outer RS(b1) 4-6 beside RS(root) 4-6, outer RS(root) 6-8, optimizer 8-13.
    assert [(iv.label, ms(iv.start_us), ms(iv.end_us)) for iv in ops(r, "OUTER")] == [
        ("OUTER_RS:b1", 4.0, 6.0), ("OUTER_RS:root", 6.0, 8.0),
        ("OUTER_AG:root", 13.0, 14.0), ("OUTER_AG:b1", 14.0, 15.0)]
    assert r.t_step_ms == pytest.approx(15.0)
    # No compute before the optimizer: the tail runs from 0 to the end of the last outer
    # reduction, not to the end of the outer all-gathers.
    assert r.metrics["outer_tail_ms"] == pytest.approx(8.0)


def test_microbatches_issue_the_outer_reduction_once():
    units, m = 4, 3
    r = simulate(config(units, fwd=1.0, root_fwd=1.0, microbatches=m))
    assert len(ops(r, "RS:")) == m * units
    assert len(ops(r, "AG:")) == m * (2 * units - 2)  # root and last unit kept for bwd
    outer = ops(r, "OUTER_AR")
    assert [iv.label for iv in outer] == ["OUTER_AR:b3", "OUTER_AR:b2", "OUTER_AR:b1",
                                         "OUTER_AR:root"]
    last_backward = [iv for iv in r.intervals if iv.label == "BWD:root"][-1]
    assert min(iv.start_us for iv in outer) >= last_backward.end_us


def test_copy_in_on_compute_before_the_reduce_scatter():
    # 1e6 x (2 + 3 x 4) bytes at 14 GB/s: 1 ms per unit
    r = simulate(config(2, fwd=1.0, root_fwd=1.0, copy_in_gbps=14.0))
    copies = ops(r, "COPY_IN")
    assert [(iv.stream, ms(iv.end_us - iv.start_us)) for iv in copies] == [("compute", 1.0)] * 2
    assert [iv.start_us for iv in ops(r, "RS:")] == [copies[0].end_us,
                                                     copies[0].end_us + RS * 1e3]


def test_validation():
    with pytest.raises(ValueError, match="strategy"):
        config(2, strategy="zero3")
    with pytest.raises(ValueError, match="distinct"):
        SimConfig((UnitSpec("a", 1, 0, 0), UnitSpec("a", 1, 0, 0)), 1, 1)


# --------------------------------------------------------------------------- runtime

TINY = GPTConfig(vocab=32, hidden=16, heads=2, ffn=32, layers=3, seq=8)


@pytest.mark.parametrize("strategy,overlap", [("hsdp", True), ("hsdp", False),
                                              ("hfsdp", True)])
def test_side_streams_issue_in_the_runtimes_order(fake_world_8, strategy, overlap):
    """The real runtime on CPU (fake 2x4 world, no delays) issues, per side stream, the
    ops the simulator issues, in the same order (steady state, two microbatches)."""
    mesh = hsdp.init_mesh(2, 4, "cpu")
    torch.manual_seed(0)
    model = GPT(TINY)
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, strategy=strategy, overlap_outer=overlap)
    hsdp.fully_shard(model, mesh=mesh, strategy=strategy, overlap_outer=overlap)
    names = {f"{model._hsdp_unit.label}/0": "GPT"} | {
        f"{b._hsdp_unit.label}/0": f"Block{i}" for i, b in enumerate(model.blocks)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, TINY.vocab, (2, TINY.seq))
    tracer = model._hsdp_unit.tracer
    for traced in (False, False, True):  # the first step records the unit order
        tracer.enabled = traced
        for m in range(2):
            with hsdp.microbatch(model, is_last=m == 1):
                lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
        model._hsdp_unit.runtime.synchronize()
    runtime: dict[str, list[str]] = {}
    for rec in sorted(tracer.take(), key=lambda r: r.start_s):
        kind, _, group = rec.label.partition(":")
        if rec.stream != "compute" and kind not in ("FREE_GRAD", "drain"):
            runtime.setdefault(rec.stream, []).append(f"{kind}:{names[group]}")
    units = gpt_units(TINY, 2, 1.0)
    sim = simulate(SimConfig(units, 2, 4, strategy, overlap, microbatches=2))
    expected: dict[str, list[str]] = {}
    for iv in sim.intervals:
        if iv.stream != "compute":
            expected.setdefault(iv.stream, []).append(iv.label)
    assert runtime == expected


# --------------------------------------------------------------------------- GPT


def test_gpt_units_match_the_real_model():
    cfg = GPTConfig(vocab=40, hidden=24, heads=2, ffn=56, layers=3, seq=12)
    model = GPT(cfg)
    units = gpt_units(cfg, mbs=2, tflops=1.0)
    block_ids = {id(p) for p in model.blocks.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in block_ids)
    assert [u.name for u in units] == ["GPT", "Block0", "Block1", "Block2"]
    assert units[0].params == root
    assert [u.params for u in units[1:]] == [sum(p.numel() for p in b.parameters())
                                             for b in model.blocks]
    tokens = 2 * cfg.seq
    attention = 4 * cfg.seq ** 2 * cfg.hidden * 2
    assert units[1].fwd_ms == pytest.approx((2 * units[1].params * tokens + attention) / 1e9)
    assert units[0].fwd_ms == pytest.approx(2 * (cfg.hidden * cfg.vocab + 2 * cfg.hidden)
                                            * tokens / 1e9)
    assert all(u.bwd_ms == pytest.approx(2 * u.fwd_ms) for u in units)
    recompute = gpt_units(GPTConfig(**{**cfg.__dict__, "checkpoint": "reentrant"}), 2, 1.0)
    assert all(u.bwd_ms == pytest.approx(3 * u.fwd_ms) for u in recompute)


def test_tflops_calibration_reproduces_the_compute_busy_time(tmp_path):
    cfg = GPTConfig(vocab=40, hidden=24, heads=2, ffn=56, layers=3, seq=12)
    path = tmp_path / "step.json"
    path.write_text(json.dumps({
        "meta": {"model": {**cfg.__dict__, "mbs": 2, "microbatches": 3}},
        "schedules": {"overlap": {"metrics": {"busy_ms": {"by_kind": {"compute": 7.5}}}}}}))
    tflops = tflops_from_results(path)
    r = simulate(SimConfig(gpt_units(cfg, 2, tflops), 2, 4, microbatches=3))
    assert r.metrics["busy_ms"]["by_kind"]["compute"] == pytest.approx(7.5)


# --------------------------------------------------------------------------- CLI

MODEL = ["--layers", "2", "--hidden", "64", "--heads", "2", "--ffn", "128", "--vocab", "100",
         "--seq", "32", "--mbs", "1", "--mesh", "2x4", "--tflops", "0.01"]


@pytest.mark.parametrize("strategy,names", [("hsdp", ["overlap", "serial"]),
                                            ("hfsdp", ["hfsdp", "hfsdp-serial"])])
def test_cli_writes_json(tmp_path, capsys, strategy, names):
    out = tmp_path / "sim.json"
    assert main(["sim", *MODEL, "--strategy", strategy, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["schedules"]) == names
    assert result["meta"]["mesh"] == {"outer": 2, "inner": 4}
    for s in result["schedules"].values():
        assert s["t_step_ms"] > s["lower_bound_ms"] > 0
        assert s["metrics"]["busy_ms"]["by_kind"]["outer"] > 0
    saving = result["summary"][f"{names[0]}_vs_{names[1]}"]["saving_ms"]
    assert saving == pytest.approx(result["schedules"][names[1]]["t_step_ms"]
                                   - result["schedules"][names[0]]["t_step_ms"])
    assert "saves" in capsys.readouterr().out


def test_cli_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    assert main(["sim", *MODEL, "--png", str(png)]) == 0
    assert png.stat().st_size > 0
