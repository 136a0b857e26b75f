"""hsdp_tools.sim: the runtime's own schedule on virtual streams, its cost model, calibration,
sweeps and the CLI."""

from __future__ import annotations

import ast
import dataclasses
import gzip
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import hsdp
from hsdp_tools.cli import main
from hsdp_tools.models import GPTConfig, LlamaConfig, build_model
from hsdp_tools.sim.calibrate import calibrate, fit_tflops, host_between_phases
from hsdp_tools.sim.costs import CostModel, PhaseCost, phase_class, work_flops
from hsdp_tools.sim.engine import Recording, Setup, evaluate, record, shard, simulate, train_step
from hsdp_tools.sim.fabric import Fabric, Link
from hsdp_tools.sim.profile import MachineProfile, calibrate_profile, held_out
from hsdp_tools.sim.trace_phases import (
    TracePhases,
    collective_drag,
    exclusive_shares,
    least_device_time,
    least_over_ranks,
    peer_wait_ms,
    phases_from_trace,
    recorded_steps,
    unprofiled_busy_ms,
    with_host_marks,
)

TINY_GPT = GPTConfig(vocab=32, hidden=16, heads=2, ffn=32, layers=3, seq=8)
TINY_LLAMA = LlamaConfig(vocab=32, hidden=16, heads=4, kv_heads=2, ffn=24, layers=3, seq=8)
FREE = 1e9  # TFLOP/s or GB/s at which compute takes no time


def _names(rec_names: dict[str, str]):
    units = "|".join(re.escape(k) for k in sorted(rec_names, key=len, reverse=True))
    pattern = re.compile(f"(?<=:)({units})(?=/|$)")
    return lambda label: pattern.sub(lambda m: rec_names[m.group(0)], label)


def _per_stream(records, names) -> dict[str, list[str]]:
    """Labels per stream in issue order: every side-stream op, and compute's phase marks
    and waits (the CPU backend does not record individual compute ops)."""
    rename = _names(names)
    out: dict[str, list[str]] = {}
    for r in records:
        if r.stream == "compute" and not r.label.startswith(("wait:", "begin:", "end:")):
            continue
        out.setdefault(r.stream, []).append(rename(r.label))
    return out


def _cpu_run(setup: Setup) -> dict[str, list[str]]:
    """The runtime on CPU (worker-thread streams, fake process group) driven as the
    simulator drives it: a one-microbatch warm-up step, then the traced step."""
    mesh = hsdp.init_mesh(setup.outer, setup.inner, "cpu")
    torch.manual_seed(0)
    model = build_model(setup.model)
    mp = hsdp.MixedPrecision(torch.bfloat16, torch.float32)
    names = shard(model, mesh, setup, mp)  # as the simulator and bench step shard it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, setup.model.vocab, (setup.mbs, setup.model.seq))
    tracer = model._hsdp_unit.tracer
    train_step(model, opt, tokens, 1)
    tracer.take()
    tracer.enabled = True
    try:
        train_step(model, opt, tokens, setup.microbatches)
    finally:
        tracer.enabled = False
    return _per_stream(tracer.take(), names)


def test_sim_runs_the_runtimes_own_schedule(fake_world_8):
    """Acceptance: the simulator (meta model, virtual streams) and a CPU run of the
    runtime (real tensors, thread streams) on the same model and mesh issue the same op
    sequence on every stream, compute's phases and waits included."""
    cases = [(TINY_LLAMA, "hsdp", True, 2), (TINY_LLAMA, "hsdp", False, 2),
             (TINY_GPT, "hfsdp", True, 3), (TINY_GPT, "hfsdp", False, 1),
             (dataclasses.replace(TINY_GPT, checkpoint="unit_non_reentrant"), "hsdp", True, 2),
             (dataclasses.replace(TINY_LLAMA, checkpoint="reentrant"), "hfsdp", True, 1),
             (TINY_LLAMA, "hsdp", True, 2, "int8"), (TINY_GPT, "hfsdp", True, 1, "fp8_e4m3")]
    for model, strategy, overlap, microbatches, *outer_reduce in cases:
        setup = Setup(model, 2, 4, strategy, overlap, microbatches,
                      outer_reduce=outer_reduce[0] if outer_reduce else "none")
        cpu = _cpu_run(setup)
        rec = record(setup)
        timing = rec.program.evaluate(CostModel().pricer(rec.program), rec.start)
        sim = _per_stream(timing.records, rec.names)
        assert sim == cpu, (model, strategy, overlap, microbatches)
        assert set(sim) == {"compute", "ag", "rs", "outer"}
        # a unit checkpointed as a whole runs its hooks again when recomputed
        recompute = any(label.startswith("begin:RECOMPUTE:") for label in sim["compute"])
        assert recompute == model.checkpoint.startswith("unit_")


def test_compressed_outer_reduction_is_priced_by_its_bytes(fake_world_8):
    """outer_reduce="int8": hsdp's outer all-reduce becomes OUTER_QAR, an all-to-all and an
    all-gather of one byte per element (plus scales) instead of an all-reduce of two."""
    programs = {q: record(Setup(TINY_LLAMA, 2, 4, reduce_dtype="bf16", outer_reduce=q)).program
                for q in ("none", "int8:64")}
    outer = {q: [c for op in p.ops if op.kind == "side" for c in op.payload
                 if c[1] == "outer"] for q, p in programs.items()}
    assert {c[0] for c in outer["none"]} == {"all_reduce"}
    assert {c[0] for c in outer["int8:64"]} == {"all_to_all", "all_gather"}
    exact = sum(c[2] for c in outer["none"])
    compressed = sum(c[2] for c in outer["int8:64"] if c[0] == "all_to_all")
    assert 0.5 <= compressed / exact < 0.7  # one byte, not two; scales and padding on top
    assert any(op.label.startswith("OUTER_QAR:") for op in programs["int8:64"].ops)


def test_memoized_meta_ops_record_the_same_program(fake_world_8, monkeypatch):
    """Identical functional ops on meta tensors are memoized (speed); the program is the
    one recorded without the memo, op for op."""
    from hsdp_tools.sim import engine

    setup = Setup(dataclasses.replace(TINY_LLAMA, checkpoint="unit_non_reentrant"), 2, 4,
                  "hfsdp", microbatches=2)

    def program():
        rec = record(setup)
        rename = _names(rec.names)
        return [(op.kind, op.stream, rename(op.label), op.deps, op.payload, op.phase)
                for op in rec.program.ops]

    fast = program()
    monkeypatch.setattr(engine._IssueCompute, "MEMO", False)
    slow = program()
    assert len(fast) > 500
    assert fast == slow


# --------------------------------------------------------------------------- timing

P = 1_000_000


def _zero_compute(**kw) -> CostModel:
    return CostModel(Fabric(Link(1.0, 0.0), Link(0.5, 0.0)), tflops=FREE, mem_gbps=FREE, **kw)


def _durations(r, prefix: str) -> list[float]:
    return [(iv.end_us - iv.start_us) / 1e3 for iv in r.intervals if iv.label.startswith(prefix)]


def test_zero_compute_serial_is_the_sum_overlap_the_max_of_the_chains(fake_world_8):
    """Embedding, one block, head and the root (``shard_units``), compute free. Forward
    all-gathers: root, embedding, block, head (kept gathered for its backward); backward:
    the block and the embedding gathered again. Reductions in backward order: head, block,
    root, embedding; each RS once its unit is gathered for backward (its backward is then
    done) and the RS stream is free, each outer reduction after its RS. Serialized, the
    outer reductions queue on rs; overlapped, each runs on outer beside the next RS."""
    model = dataclasses.replace(TINY_GPT, layers=1, hidden=256, ffn=512, vocab=512)
    costs = _zero_compute()
    over = evaluate(record(Setup(model, 2, 4)), costs)
    ser = evaluate(record(Setup(model, 2, 4, overlap_outer=False)), costs)
    ag = _durations(over, "AG:")
    assert [iv.label.split("/")[0] for iv in over.intervals if iv.label.startswith("AG:")] == [
        "AG:HSDPGPT", "AG:Embed", "AG:Block0", "AG:Head", "AG:Block0", "AG:Embed"]
    head_ready, blk_ready, emb_ready = (sum(ag[:n]) for n in (4, 5, 6))
    rs = {k: _durations(over, f"RS:{k}")[0] for k in ("Head", "Block0", "HSDPGPT", "Embed")}
    o = {k: _durations(over, f"OUTER_AR:{k}")[0] for k in rs}
    ready = {"Head": head_ready, "Block0": blk_ready, "HSDPGPT": 0.0, "Embed": emb_ready}
    rs_end = outer_end = serial_end = 0.0
    for k in ("Head", "Block0", "HSDPGPT", "Embed"):
        rs_end = max(rs_end, ready[k]) + rs[k]
        outer_end = max(outer_end, rs_end) + o[k]
        serial_end = max(serial_end, ready[k]) + rs[k] + o[k]
    assert over.t_step_ms == pytest.approx(outer_end)
    assert ser.t_step_ms == pytest.approx(serial_end)
    assert over.t_step_ms < ser.t_step_ms
    assert {iv.stream for iv in over.intervals if iv.label.startswith("OUTER")} == {"outer"}
    assert {iv.stream for iv in ser.intervals if iv.label.startswith("OUTER")} == {"rs"}


def test_compute_is_the_models_flops_at_the_given_throughput(fake_world_8):
    """Compute busy time = forward FLOPs x 3 (backward: two matmuls per matmul) at the
    given TFLOP/s, counted by hand: every weight matrix 2 x in x out per token, attention
    4 x seq^2 x hidden per sequence (scores and weighted sum) of which a causal kernel
    does half, the head included."""
    cfg = dataclasses.replace(TINY_GPT, hidden=64, ffn=96, vocab=128, seq=32)
    mbs, tflops = 2, 1e-3
    r = evaluate(record(Setup(cfg, 2, 4, mbs=mbs)), CostModel(tflops=tflops, mem_gbps=FREE))
    tokens = mbs * cfg.seq
    h, f = cfg.hidden, cfg.ffn
    attention = 0.5 * 4 * mbs * cfg.seq ** 2 * h  # causal: the lower triangle
    block = 2 * tokens * (4 * h * h + 2 * h * f) + attention
    forward = cfg.layers * block + 2 * tokens * h * cfg.vocab
    # the fused attention's backward recomputes the scores: 2.5 x its forward, not 2 x
    attention_extra = 0.5 * cfg.layers * attention
    expected_ms = (3 * forward + attention_extra) / (tflops * 1e12) * 1e3
    assert r.metrics["busy_ms"]["by_kind"]["compute"] == pytest.approx(expected_ms, rel=1e-9)


def test_backward_drag_stretches_compute_beside_collectives(fake_world_8):
    """``CostModel.drag`` of a phase class slows its compute only while a collective
    runs: the backward's compute busy time grows by drag x its time beside collectives;
    with collectives that take no time, nothing changes; other classes keep their time."""
    rec = record(Setup(TINY_LLAMA, 2, 4))
    costs = CostModel(tflops=1e-3, mem_gbps=1.0, fabric=Fabric(Link(1e-3, 0.0),
                                                                Link(1e-3, 0.0)))
    dragged = dataclasses.replace(costs, drag={"BWD:LlamaBlock": 0.5})
    base, slow = evaluate(rec, costs), evaluate(rec, dragged)

    def busy(r, kind):
        return sum(iv.end_us - iv.start_us for iv in r.intervals
                   if iv.stream == "compute" and iv.label.startswith(kind))

    assert busy(slow, "BWD:") > busy(base, "BWD:") * 1.05
    assert busy(slow, "FWD:") == pytest.approx(busy(base, "FWD:"))
    assert slow.t_step_ms > base.t_step_ms
    free = dataclasses.replace(costs, fabric=Fabric(Link(FREE, 0.0), Link(FREE, 0.0)),
                               mem_gbps=FREE)
    free_dragged = evaluate(rec, dataclasses.replace(free, drag=dragged.drag))
    assert busy(free_dragged, "BWD:") == pytest.approx(busy(evaluate(rec, free), "BWD:"))
    with pytest.raises(ValueError, match="drag"):
        CostModel(drag={"BWD:LlamaBlock": 1.0})


def test_host_bound_step_follows_the_host(fake_world_8):
    rec = record(Setup(TINY_LLAMA, 2, 4))
    n_ops = sum(op.kind == "compute" for op in rec.program.ops[rec.start:])
    n_side = sum(op.kind == "side" for op in rec.program.ops[rec.start:])
    r = evaluate(rec, CostModel(tflops=FREE, mem_gbps=FREE, host_us_per_op=100.0,
                                host_us_per_side_op=10.0))
    assert r.metrics["host_busy_ms"] == pytest.approx(0.1 * n_ops + 0.01 * n_side)
    assert r.t_step_ms >= r.metrics["host_busy_ms"]
    fast = evaluate(rec, CostModel(tflops=FREE, mem_gbps=FREE))
    assert r.t_step_ms > fast.t_step_ms + 0.5 * r.metrics["host_busy_ms"]
    # per side-op class, its own where measured (else their mean), plus the per-op cost
    ops = rec.program.ops[rec.start:]
    n_free = sum(op.kind == "side" and op.label.startswith("FREE_GRAD:") for op in ops)
    n_ag = sum(op.kind == "side" and op.stream == "ag" and op.label.startswith("AG:")
               for op in ops)
    assert n_free > 0 and n_ag > 0
    classed = evaluate(rec, CostModel(tflops=FREE, mem_gbps=FREE, host_us_per_op=100.0,
                                      host_us_per_side_op=10.0,
                                      side_host_us={"rs:FREE_GRAD": 30.0, "ag:AG": 50.0}))
    assert classed.metrics["host_busy_ms"] == pytest.approx(
        0.1 * n_ops + 0.04 * n_free + 0.06 * n_ag + 0.05 * (n_side - n_free - n_ag))


def test_ranks_run_together_when_every_rank_has_its_costs(fake_world_8):
    """``CostModel.peers``: a rank slow on the host holds up the collectives of its
    groups, and through them every rank (rank 5 is in rank 1's outer group, rank 1 in
    rank 0's inner group); alike ranks change nothing."""
    rec = record(Setup(TINY_LLAMA, 2, 4))
    costs = CostModel(tflops=1e-3, host_us_per_op=10.0, host_us_per_side_op=5.0)
    slow = dataclasses.replace(costs, host_us_per_op=40.0)
    alone, slow_alone = evaluate(rec, costs), evaluate(rec, slow)
    alike = evaluate(rec, dataclasses.replace(costs, peers=(costs,) * 7))
    assert alike.t_step_ms == pytest.approx(alone.t_step_ms)
    assert alike.intervals == alone.intervals
    together = evaluate(rec, dataclasses.replace(
        costs, peers=tuple(slow if r == 5 else costs for r in range(1, 8))))
    assert together.t_step_ms >= slow_alone.t_step_ms - 1e-9
    assert together.t_step_ms > 1.5 * alone.t_step_ms
    assert together.metrics["host_busy_ms"] == pytest.approx(alone.metrics["host_busy_ms"])
    waited = together.metrics["busy_ms"]["by_kind"]  # rank 0's ops span their waits
    assert waited["inner_ag"] > alone.metrics["busy_ms"]["by_kind"]["inner_ag"]
    # peers of another mesh's calibration: every rank as rank 0
    other = evaluate(rec, dataclasses.replace(costs, peers=(slow,)))
    assert other.t_step_ms == pytest.approx(alone.t_step_ms)


def test_ops_outside_every_unit_are_memory_bound(fake_world_8):
    """The loss (softmax over the logits, and its backward) runs outside every unit's
    phases, so no phase's calibrated TFLOP/s absorbs it: its bytes at ``mem_gbps``, once
    per microbatch."""
    costs = CostModel(tflops=1e-3, mem_gbps=1.0)
    seconds = {}
    for m in (1, 3):
        rec = record(Setup(TINY_GPT, 2, 4, microbatches=m))
        ops = [op for op in rec.program.ops[rec.start:] if op.kind == "compute" and op.phase < 0]
        assert {"aten::_log_softmax", "aten::_log_softmax_backward_data"} <= {
            op.payload.name for op in ops}
        price = costs.pricer(rec.program)
        seconds[m] = sum(price(op)[1] for op in ops)
        assert seconds[m] == pytest.approx(sum(op.payload.nbytes for op in ops) / 1e9)
    assert seconds[1] > 0 and seconds[3] == pytest.approx(3 * seconds[1], rel=0.1)


def test_optimizer_and_copy_in_follow_the_shard_and_the_microbatches(fake_world_8):
    """Memory-bound phases: hfsdp's optimizer works on 1/outer of hsdp's shard; the
    optimizer runs once per step, the copy-in once per unit and microbatch. (Side ops'
    casts beside compute: one between two copy-in ops would split its record.)"""
    costs = CostModel(tflops=FREE, mem_gbps=1.0,
                      exclusive=dict.fromkeys(("inner_ag", "inner_rs", "outer"), 0.0))
    opt = {}
    for strategy in ("hsdp", "hfsdp"):
        r = evaluate(record(Setup(TINY_GPT, 2, 4, strategy, microbatches=3)), costs)
        opt[strategy] = sum(_durations(r, "OPTIMIZER:"))
        assert len(_durations(r, "OPTIMIZER:")) == 1
        units = TINY_GPT.layers + 3  # the blocks, the embedding, the head and the root
        assert len(_durations(r, "COPY_IN:")) == 3 * units
        assert len(_durations(r, "RS:")) == 3 * units
        assert len(_durations(r, "OUTER_A" if strategy == "hsdp" else "OUTER_RS")) == units
    assert opt["hsdp"] / opt["hfsdp"] == pytest.approx(2.0, rel=0.1)


def test_measured_phase_costs_apply_to_their_setup_only(fake_world_8):
    setup = Setup(TINY_LLAMA, 2, 4, microbatches=2)
    rec = record(setup)
    costs = CostModel(tflops=FREE, mem_gbps=FREE, phases={
        "FWD:LlamaBlock": PhaseCost(host_ms=1.0, device_ms=2.0)},
        phases_key=setup.phase_key())
    r = evaluate(rec, costs)
    fwd = [iv for iv in r.intervals if iv.label == "FWD:Block1"]
    assert sum(iv.end_us - iv.start_us for iv in fwd) == pytest.approx(2 * 2000.0)
    assert r.metrics["host_busy_ms"] == pytest.approx(2 * TINY_LLAMA.layers * 1.0)
    other = evaluate(record(dataclasses.replace(setup, mbs=2)), costs)
    assert other.metrics["busy_ms"]["by_kind"]["compute"] == pytest.approx(0.0, abs=1e-6)


def test_llama_70b_on_the_meta_device(fake_world_8):
    """A 70B model needs no memory: one block of it on a 2x4 mesh, timed."""
    from hsdp_tools.models import preset

    rec = record(Setup(preset("llama-70b", layers=1, seq=4096), 2, 4))
    r = evaluate(rec, CostModel())
    assert r.metrics["busy_ms"]["by_kind"]["compute"] > 10
    assert r.t_step_ms >= r.metrics["lower_bound_ms"] > 0


# --------------------------------------------------------------------------- calibration


def _bench_json(tmp_path: Path, setup: Setup, busy_ms: float | dict, trace: str | None = None,
                **extra) -> Path:
    model = {**dataclasses.asdict(setup.model), "mbs": setup.mbs,
             "microbatches": setup.microbatches, "dtype": setup.dtype,
             "reduce_dtype": setup.reduce_dtype}
    path = tmp_path / "step.json"
    path.write_text(json.dumps({
        "meta": {"model": model, "mesh": {"outer": setup.outer, "inner": setup.inner}},
        "schedules": {"overlap": {"metrics": {"busy_ms": {"by_kind": busy_ms if isinstance(
            busy_ms, dict) else {"compute": busy_ms}}},
                                  "trace": trace, **extra}}}))
    return path


def test_tflops_calibration_reproduces_the_compute_busy_time(fake_world_8, tmp_path):
    setup = Setup(TINY_GPT, 2, 4, microbatches=3)
    costs = calibrate(_bench_json(tmp_path, setup, 7.5), CostModel(mem_gbps=100.0))
    r = evaluate(record(setup), costs)
    assert r.metrics["busy_ms"]["by_kind"]["compute"] == pytest.approx(7.5)
    with pytest.raises(ValueError, match="cannot fit"):
        fit_tflops(record(setup), 1e-9, 100.0)


def test_calibration_scales_collectives_and_spreads_host_time(fake_world_8, tmp_path):
    """Without a trace: each collective kind's busy time and the host time of the JSON."""
    setup = Setup(TINY_GPT, 2, 4)
    measured = {"compute": 3.0, "inner_ag": 2.0, "inner_rs": 1.5, "outer": 4.0}
    path = _bench_json(tmp_path, setup, measured, t_host_ms=6.0)
    r = evaluate(record(setup), calibrate(path, CostModel(mem_gbps=100.0)))
    busy = r.metrics["busy_ms"]["by_kind"]
    assert {k: busy[k] for k in measured} == pytest.approx(measured)
    assert r.metrics["host_busy_ms"] == pytest.approx(6.0)
    assert r.t_step_ms >= 6.0 - 1e-9
    # The scale is relative to the fabric the run emulated: a slower outer link than the
    # run's stays slower.
    data = json.loads(path.read_text())
    data["meta"]["fabric"] = {"inner": {"bus_gbps": 370.0, "latency_us": 0.0},
                              "outer": {"bus_gbps": 40.0, "latency_us": 0.0}}
    path.write_text(json.dumps(data))
    slow = Fabric(Link(370.0, 0.0), Link(10.0, 0.0))
    r = evaluate(record(setup), calibrate(path, CostModel(slow, mem_gbps=100.0)))
    assert r.metrics["busy_ms"]["by_kind"]["outer"] == pytest.approx(4 * measured["outer"])
    # Another schedule's own collective busy times (the rest stays the overlapped run's).
    serial = {**measured, "outer": 3.0}
    data["schedules"]["serial"] = {"metrics": {"busy_ms": {"by_kind": serial}}}
    path.write_text(json.dumps(data))
    same = CostModel(Fabric(Link(370.0, 0.0), Link(40.0, 0.0)), mem_gbps=100.0)  # the run's
    costs = calibrate(path, same, times_from="serial")
    r = evaluate(record(dataclasses.replace(setup, overlap_outer=False)), costs)
    assert r.metrics["busy_ms"]["by_kind"]["outer"] == pytest.approx(3.0)
    assert costs.tflops == calibrate(path, same).tflops
    # Stream times of a step without the profiler, when the JSON has them, win.
    data["schedules"]["serial"]["side_ms"] = [
        ["outer", "OUTER_AR:Block0/0", 1.0], ["outer", "OUTER_AR:Block1/0", 1.5],
        ["ag", "FREE:Block0/0", 0.0]]  # not a collective
    path.write_text(json.dumps(data))
    costs = calibrate(path, same, times_from="serial")
    r = evaluate(record(dataclasses.replace(setup, overlap_outer=False)), costs)
    assert r.metrics["busy_ms"]["by_kind"]["outer"] == pytest.approx(2.5)
    assert r.metrics["busy_ms"]["by_kind"]["inner_ag"] == pytest.approx(measured["inner_ag"])


def _ev(name, ts, dur, tid=1, cat="user_annotation", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": args}


def _kernel(corr, ts, dur, launch_ts, tid=1, name="gemm"):
    return [_ev("cudaLaunchKernel", launch_ts, 1, tid, "cuda_runtime", correlation=corr),
            _ev(name, ts, dur, 7, "kernel", correlation=corr)]


def test_phases_from_a_trace():
    """Host time: innermost open phase, side ops excluded; device time: kernels by their
    launch's thread and time; instances: begin marks; per side-op kind, the share of its
    own kernels' time that held compute up (collective kernels excluded)."""
    events = [
        _ev("hsdp.begin:FWD:Llama3", 0, 0), _ev("hsdp.begin:FWD:LlamaBlock0", 10, 0),
        _ev("hsdp:ag:AG:LlamaBlock1/0", 12, 4),  # 4 us of side op inside the block
        _ev("hsdp.end:FWD:LlamaBlock0", 30, 0), _ev("hsdp.begin:FWD:LlamaBlock1", 30, 0),
        _ev("hsdp.end:FWD:LlamaBlock1", 50, 0), _ev("hsdp.end:FWD:Llama3", 60, 0),
        _ev("hsdp.begin:OPTIMIZER:Llama3", 100, 0), _ev("hsdp.end:OPTIMIZER:Llama3", 120, 0),
        # backward thread
        _ev("hsdp.begin:BWD:LlamaBlock1", 70, 0, tid=2), _ev("hsdp.end:BWD:LlamaBlock1", 90, 0,
                                                                tid=2),
        # block 0; the second: a cast in the AG, 2 of its 5 us beside kernel 1, 3 holding
        # up kernel 3 (launched long before)
        *_kernel(1, 100, 7, 20), *_kernel(2, 105, 5, 13),
        *_kernel(3, 120, 3, 40), *_kernel(4, 130, 11, 80, tid=2), *_kernel(5, 140, 2, 5),
        *_kernel(6, 150, 9, 14, name="ncclDevKernel_AllGather"),  # the AG's collective
    ]
    m = phases_from_trace({"traceEvents": events})
    ph = {k: [v[0], round(v[1] * 1e3, 6), round(v[2] * 1e3, 6)] for k, v in m.phases.items()}
    assert ph == {"FWD:Llama": [1, 20.0, 2.0], "FWD:LlamaBlock": [2, 36.0, 10.0],
                  "BWD:LlamaBlock": [1, 20.0, 11.0], "OPTIMIZER:Llama": [1, 20.0, 0.0]}
    assert m.side_host_ms == {"ag:AG": [0.004]}
    assert m.span_ms == pytest.approx(0.12)
    assert m.exclusive == {"inner_ag": pytest.approx(0.6)}
    assert m.collectives == {"AG:LlamaBlock/0": [0.009]}
    # per phase instance, its device ms and those beside a collective kernel (none here)
    assert sorted(m.instances) == [("BWD:LlamaBlock", 0.011, 0.0), ("FWD:Llama", 0.002, 0.0),
                                   ("FWD:LlamaBlock", 0.003, 0.0),
                                   ("FWD:LlamaBlock", 0.007, 0.0)]

    # Host times from a step without the profiler (every host time halved): device times
    # and instances stay the trace's.
    marks = [[e["tid"], e["name"], e["ts"] / 2, e["dur"] / 2] for e in events
             if e["cat"] == "user_annotation"]
    fast = with_host_marks(m, [marks])
    assert {k: [v[0], round(v[1] * 1e3, 6), round(v[2] * 1e3, 6)]
            for k, v in fast.phases.items()} == {
        k: [v[0], v[1] / 2, v[2]] for k, v in ph.items()}
    assert fast.side_host_ms == {"ag:AG": [0.002]} and fast.span_ms == pytest.approx(0.06)

    # Several steps: per phase class, side op and span, the median over the steps; a
    # step three times as slow (a hiccup) and one twice as fast move nothing.
    slow = [[tid, name, ts * 3, dur * 3] for tid, name, ts, dur in marks]
    faster = [[tid, name, ts / 2, dur / 2] for tid, name, ts, dur in marks]
    steady = with_host_marks(m, [slow, marks, faster])
    assert steady.phases == fast.phases
    assert steady.side_host_ms == {"ag:AG": [0.002]} and steady.span_ms == pytest.approx(0.06)
    assert with_host_marks(m, [marks, slow, marks]).phases == fast.phases


def test_per_step_records_combine_by_the_median_per_op():
    """The unprofiled steps' stream times: each op (by stream, label and occurrence) the
    median over the steps; older JSONs' single step read as one step."""
    step = [["outer", "OUTER_AR:Block0/0", 1.0], ["outer", "OUTER_AR:Block0/0", 2.0],
            ["rs", "RS:Block0/0", 0.5], ["ag", "FREE:Block0/0", 0.1]]
    waited = [[s, label, ms * 10 if label.startswith("RS") else ms] for s, label, ms in step]
    fast = [[s, label, ms / 2] for s, label, ms in step]
    assert unprofiled_busy_ms([step]) == {"outer": 3.0, "inner_rs": 0.5}
    assert unprofiled_busy_ms([step, waited, fast]) == {"outer": 3.0, "inner_rs": 0.5}
    assert unprofiled_busy_ms([step, fast]) == {"outer": 2.25, "inner_rs": 0.375}
    assert recorded_steps({"side_ms": step}, "side_ms") == [step]
    assert recorded_steps({"side_ms_steps": [step, [], fast]}, "side_ms") == [step, fast]
    assert recorded_steps({"side_ms": None, "side_ms_steps": None}, "side_ms") == []


def test_least_device_time_over_profiled_steps():
    """Per phase class, the least device time of the profiled steps that ran it as many
    times; per side-op kind, the largest share held up; everything else is the first
    step's."""
    first = TracePhases({"FWD:Block": [2, 1.0, 9.0], "BWD:Block": [2, 2.0, 8.0]},
                        {"ag:AG": [0.1]}, 5.0, collectives={"AG:Block/0": [1.0]})
    second = TracePhases({"FWD:Block": [2, 3.0, 7.0], "BWD:Block": [2, 4.0, 9.0]},
                         {"ag:AG": [0.2]}, 6.0)
    partial = TracePhases({"FWD:Block": [1, 0.5, 1.0]}, {}, 1.0)
    second.exclusive, partial.exclusive = {"outer": 0.5, "inner_ag": 0.1}, {"outer": 0.7}
    least = least_device_time([first, second, partial])
    assert least.phases == {"FWD:Block": [2, 1.0, 7.0], "BWD:Block": [2, 2.0, 8.0]}
    # held up only where the GPU ran behind the host: the largest share over the steps
    assert least.exclusive == {"outer": 0.7, "inner_ag": 0.1}
    assert least.side_host_ms == {"ag:AG": [0.1]} and least.span_ms == 5.0
    assert least.collectives == first.collectives
    assert first.phases["FWD:Block"] == [2, 1.0, 9.0]  # not modified in place


def test_drag_beside_collective_kernels():
    """A phase instance's time beside NCCL kernels (any stream's, overlapping ones counted
    once; the emulation's sleep kernel is none); per class, the drag is the slope of the
    instances' device time over it, and each step's device time is taken without it
    before the least over steps."""
    events = [
        _ev("hsdp.begin:BWD:Block0", 0, 0), _ev("hsdp.end:BWD:Block0", 10, 0),
        _ev("hsdp.begin:BWD:Block1", 10, 0), _ev("hsdp.end:BWD:Block1", 20, 0),
        _ev("hsdp:outer:OUTER_AR:Block0/0", 16, 3),
        *_kernel(1, 100, 10, 5), *_kernel(2, 110, 10, 15),
        *_kernel(3, 105, 10, 17, name="ncclDevKernel_AllReduce"),
        *_kernel(4, 108, 4, 18, name="ncclDevKernel_AllReduce"),
        *_kernel(5, 118, 4, 18, name="ncclDevKernel_AllReduce"),
        *_kernel(6, 100, 5, 18, name="at::cuda::spin_kernel(long)"),  # emulation: no drag
    ]
    m = phases_from_trace({"traceEvents": events})
    assert sorted(m.instances) == [("BWD:Block", 0.01, 0.005), ("BWD:Block", 0.01, 0.007)]

    # device ms = 10 + 0.5 * beside, over two steps; FWD: too little overlap; COPY_IN: too
    # few instances; OPTIMIZER: slower alone than beside (clamped to 0)
    def step(bwd, fwd=((0.0, 1.0),) * 4, other=()):  # (ms beside, ms) per instance
        inst = ([("BWD:Block", ms, o) for o, ms in bwd] + [("FWD:Block", ms, o) for o, ms in fwd]
                + list(other))
        phases = {}
        for cls, ms, _ in inst:
            phases.setdefault(cls, [0, 1.0, 0.0])
            phases[cls][0] += 1
            phases[cls][2] += ms
        return TracePhases(phases, {}, 1.0, instances=inst)

    little = ((0.0, 1.0), (0.2, 1.1), (0.0, 1.0), (0.0, 1.0))
    first = step([(0, 10), (2, 11), (4, 12), (0, 10)], little,
                 [("COPY_IN:Block/0", 2.0, 1.0), ("COPY_IN:Block/0", 1.0, 0.0)]
                 + [("OPTIMIZER:M", 5.0 - o, o) for o in (0, 1, 2, 3)])
    second = step([(8, 14), (0, 10), (0, 10), (0, 10)])
    assert collective_drag([first, second]) == {"BWD:Block": pytest.approx(0.5),
                                                "OPTIMIZER:M": 0.0}
    least = least_device_time([first, second])
    assert least.drag == collective_drag([first, second])
    # each step's BWD without its drag: 43 - 0.5 * 6 = 40 and 44 - 0.5 * 8 = 40
    assert least.phases["BWD:Block"][2] == pytest.approx(40.0)
    assert least.phases["FWD:Block"][2] == pytest.approx(4.0)  # the least, as before
    alone = least_device_time([step([(0, 10)] * 4)])  # nothing beside: nothing to measure
    assert alone.drag == {} and alone.phases["BWD:Block"][2] == pytest.approx(40.0)


def test_exclusive_share_counts_compute_held_up_not_idle():
    """A side op's cast holds compute up only while compute's next kernel is already
    launched; in a gap where the host has not launched it yet, compute is idle anyway."""
    compute = [(0, 10, 0), (20, 30, 25),  # gap 10-20: the next kernel launched at 25
               (40, 50, 35), (60, 70, 45)]  # gap 50-60: launched at 45, held up
    side = [("inner_ag", 12, 18), ("inner_ag", 52, 58), ("outer", 62, 66)]
    assert exclusive_shares(side, compute) == {"inner_ag": 0.5, "outer": 0.0}


def test_blocked_launches_and_peer_waits_are_not_host_or_transfer_time():
    """A launch call that waited for room in the GPU's queue is taken out of its phase's
    host time; a collective kernel's time beyond the fastest of its class is a wait for
    the other ranks."""
    events = [_ev("hsdp.begin:OPTIMIZER:Llama3", 0, 0), _ev("hsdp.end:OPTIMIZER:Llama3", 500, 0),
              _ev("cudaLaunchKernel", 100, 300, 1, "cuda_runtime", correlation=99)]
    for i, (ts, dur) in enumerate([(600, 10), (700, 40), (800, 12)]):  # RS of three blocks
        events += [_ev(f"hsdp:rs:RS:LlamaBlock{i}/0", 600 + i, 1),
                   *_kernel(10 + i, ts, dur, 600 + i, name="ncclDevKernel_ReduceScatter")]
    m = phases_from_trace({"traceEvents": events})
    assert m.phases["OPTIMIZER:Llama"][1] == pytest.approx(0.2)  # 0.5 ms less 0.3 blocked
    assert m.blocked_ms == {"OPTIMIZER:Llama": pytest.approx(0.3)}
    assert peer_wait_ms(m) == {"inner_rs": pytest.approx(0.032)}  # (40 - 10) + (12 - 10) us
    # without the profiler the host ran further ahead and its launches waited longer: the
    # optimizer's 0.9 ms are the trace's 0.2 ms of host and 0.7 blocked (0.5: 0.3 + 0.2)
    marks = [[1, "hsdp.begin:OPTIMIZER:Llama3", 0, 0], [1, "hsdp.end:OPTIMIZER:Llama3", 900, 0]]
    for end, blocked in ((900, 0.7), (500, 0.3), (100, 0.0)):
        marks[1][2] = end
        steady = with_host_marks(m, [marks])
        assert steady.phases["OPTIMIZER:Llama"][1] == pytest.approx(min(0.2, end / 1e3))
        assert steady.blocked_ms == {"OPTIMIZER:Llama": pytest.approx(blocked)}


def _llama_step(kernel_us: float = 3000, host_us: tuple[float, ...] = (1000,) * 3
                ) -> list[dict]:
    """A profiled forward of TINY_LLAMA: the root's 1 ms of host, then each block's
    ``host_us`` of host and one kernel of ``kernel_us``; the optimizer's 1 ms of host."""
    labels = ["FWD:Llama90"] + [f"FWD:LlamaBlock{90 + i}" for i in range(1, 4)]
    events, t = [], 0
    for i, (label, host) in enumerate(zip(labels[1:], host_us)):
        events += [_ev(f"hsdp.begin:{label}", t, 0), _ev(f"hsdp.end:{label}", t + host, 0),
                   *_kernel(i, 10_000 + kernel_us * i, kernel_us, t + 10)]
        t += host
    return events + [_ev(f"hsdp.begin:{labels[0]}", -1000, 0),
                     _ev(f"hsdp.end:{labels[0]}", t, 0),
                     _ev("hsdp.begin:OPTIMIZER:Llama90", t, 0),
                     _ev("hsdp.end:OPTIMIZER:Llama90", t + 1000, 0)]


def _write_trace(path: Path, events: list[dict]) -> None:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_calibrate_from_json_and_trace(fake_world_8, tmp_path):
    """Per-phase measured times reproduce on the calibrated setup; the host times are
    scaled to the unprofiled host time of the JSON."""
    setup = Setup(TINY_LLAMA, 2, 4, microbatches=1)
    _write_trace(tmp_path / "trace_overlap.json.gz", _llama_step())
    path = _bench_json(tmp_path, setup, 50.0, trace="/elsewhere/trace_overlap.json.gz",
                       t_host_ms=2.5)  # the trace's span is 5 ms: host times halve
    costs = calibrate(path, CostModel(mem_gbps=100.0))
    assert costs.phases["FWD:LlamaBlock"] == PhaseCost(host_ms=0.5, device_ms=3.0)
    assert "OPTIMIZER:Llama" not in costs.phases
    rec = record(setup)
    r = evaluate(rec, costs)
    fwd = [iv for iv in r.intervals if iv.label == "FWD:Block2"]
    assert sum(iv.end_us - iv.start_us for iv in fwd) == pytest.approx(3000.0)
    # Host time that the traced phases and side ops do not cover (here: 3 ms more) goes
    # to the side-stream ops, which the runtime's hooks between units issue.
    host = r.metrics["host_busy_ms"]
    more = host_between_phases(costs, rec, host + 3.0)
    n_side = sum(op.kind == "side" for op in rec.program.ops[rec.start:])
    assert more.host_us_per_side_op == pytest.approx(costs.host_us_per_side_op + 3e3 / n_side)
    assert evaluate(rec, more).metrics["host_busy_ms"] == pytest.approx(host + 3.0)
    # TFLOP/s: the FLOPs the kernels of the measured model phases do (the root's and the
    # blocks'; not the embedding's and head's, untraced here) over their device time
    flops = sum(work_flops(op) for op in rec.program.ops[rec.start:]
                if op.kind == "compute" and phase_class(op.label) in ("FWD:Llama",
                                                                      "FWD:LlamaBlock"))
    assert costs.tflops == pytest.approx(flops / 9e-3 / 1e12)


def test_calibrate_from_several_steps(fake_world_8, tmp_path):
    """Several profiled steps: per phase class, the least device time (the first step's
    kernels slowed down here); several recorded steps: per phase class, the median host
    time (one step's hiccup in one block ignored). A JSON of one step each takes them."""
    setup = Setup(TINY_LLAMA, 2, 4, microbatches=1)
    names = ["trace_overlap.json.gz", "trace_overlap.2.json.gz", "trace_overlap.3.json.gz"]
    for name, kernel_us in zip(names, (4000, 3000, 3500)):
        _write_trace(tmp_path / name, _llama_step(kernel_us))

    def marks(host_us: tuple[float, ...]) -> list[list]:
        return [[e["tid"], e["name"], e["ts"], e["dur"]] for e in _llama_step(3000, host_us)
                if e["cat"] == "user_annotation"]

    steady, hiccup = marks((1000,) * 3), marks((1000, 5000, 1000))
    path = _bench_json(tmp_path, setup, 50.0, trace=names[0], traces=names, t_host_ms=2.5,
                       host_marks_steps=[steady, hiccup, steady])
    costs = calibrate(path, CostModel(mem_gbps=100.0))
    assert costs.phases["FWD:LlamaBlock"] == PhaseCost(host_ms=0.5, device_ms=3.0)
    assert costs.phases["FWD:Llama"] == PhaseCost(host_ms=0.5, device_ms=0.0)
    # One step of each, as older JSONs have: the first trace's device time, the host
    # time of the one recorded step
    path = _bench_json(tmp_path, setup, 50.0, trace=names[0], t_host_ms=2.5,
                       host_marks=hiccup)
    costs = calibrate(path, CostModel(mem_gbps=100.0))
    block = costs.phases["FWD:LlamaBlock"]
    assert block.device_ms == 4.0 and block.host_ms == pytest.approx(7 / 9 * 2.5 / 3)


def test_calibrate_every_rank(fake_world_8, tmp_path):
    """A real run with every rank's host marks (``other_ranks``): each rank gets its own
    host costs (``CostModel.peers``), all scaled by the timed host time over the slowest
    rank's span; the ranks then run together, and a slow one holds up rank 0."""
    setup = Setup(TINY_LLAMA, 2, 4, microbatches=1)
    _write_trace(tmp_path / "trace_overlap.json.gz", _llama_step())

    def marks(host_us: tuple[float, ...]) -> list[list]:
        return [[e["tid"], e["name"], e["ts"], e["dur"]] for e in _llama_step(3000, host_us)
                if e["cat"] == "user_annotation"]

    steady, slow = marks((1000,) * 3), marks((1000, 5000, 1000))  # spans 5 and 9 ms
    others = [{"host_marks_steps": [slow if r == 4 else steady] * 3} for r in range(1, 8)]
    path = _bench_json(tmp_path, setup, 50.0, trace="trace_overlap.json.gz", t_host_ms=2.5,
                       host_marks_steps=[steady] * 3, other_ranks=others)
    costs = calibrate(path, CostModel(mem_gbps=100.0))
    assert len(costs.peers) == 7
    scale = 2.5 / 9  # the timed host time over the slowest rank's span
    assert costs.phases["FWD:LlamaBlock"].host_ms == pytest.approx(1.0 * scale)
    assert costs.peers[3].phases["FWD:LlamaBlock"].host_ms == pytest.approx(7 / 3 * scale)
    assert costs.peers[0].phases == costs.phases
    rec = record(setup)
    together, rank0 = evaluate(rec, costs), evaluate(rec, dataclasses.replace(costs, peers=()))
    assert together.t_step_ms > rank0.t_step_ms
    # an older JSON (rank 0's marks alone): one model, scaled to rank 0's span
    data = json.loads(path.read_text())
    del data["schedules"]["overlap"]["other_ranks"]
    path.write_text(json.dumps(data))
    alone = calibrate(path, CostModel(mem_gbps=100.0))
    assert alone.peers == () and alone.phases["FWD:LlamaBlock"].host_ms == pytest.approx(0.5)


def test_collective_times_are_the_least_over_the_ranks():
    """On real NCCL an op's stream time holds its wait for the last rank to arrive."""
    rank0 = [[["outer", "OUTER_AR:u", 5.0], ["ag", "AG:u", 1.0]]] * 2
    rank1 = [[["outer", "OUTER_AR:u", 2.0], ["ag", "AG:u", 3.0]],
             [["outer", "OUTER_AR:u", 6.0], ["ag", "AG:u", 0.5]]]
    assert least_over_ranks([rank0, rank1]) == [
        [["outer", "OUTER_AR:u", 2.0], ["ag", "AG:u", 1.0]],
        [["outer", "OUTER_AR:u", 5.0], ["ag", "AG:u", 0.5]]]
    with pytest.raises(ValueError, match="different side ops"):
        least_over_ranks([rank0, [[["ag", "AG:u", 1.0], ["outer", "OUTER_AR:u", 5.0]]] * 2])


def test_phase_class_drops_unit_numbers():
    assert phase_class("COPY_IN:LlamaBlock12/0") == "COPY_IN:LlamaBlock/0"
    assert phase_class("BWD:GPT3") == "BWD:GPT"
    assert phase_class("") == ""


# --------------------------------------------------------------------------- CLI

MODEL = ["--model", "gpt", "--layers", "2", "--hidden", "64", "--heads", "2", "--ffn", "128",
         "--vocab", "100", "--seq", "32", "--mesh", "2x4", "--tflops", "0.01"]


@pytest.mark.parametrize("strategy,names", [("hsdp", ["overlap", "serial"]),
                                            ("hfsdp", ["hfsdp", "hfsdp-serial"])])
def test_cli_writes_json(tmp_path, capsys, strategy, names):
    out = tmp_path / "sim.json"
    assert main(["sim", *MODEL, "--strategy", strategy, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["schedules"]) == names
    assert result["meta"]["mesh"] == {"outer": 2, "inner": 4}
    for s in result["schedules"].values():
        assert s["t_step_ms"] >= s["lower_bound_ms"] > 0
        assert s["metrics"]["busy_ms"]["by_kind"]["outer"] > 0
    saving = result["summary"][f"{names[0]}_vs_{names[1]}"]["saving_ms"]
    assert saving == pytest.approx(result["schedules"][names[1]]["t_step_ms"]
                                   - result["schedules"][names[0]]["t_step_ms"])
    assert "saves" in capsys.readouterr().out


def test_cli_exclusive_share_holds_up_compute(tmp_path):
    """``--exclusive``: the collectives' own casts hold up compute for that share of their
    time (0: they all run beside compute, so the step is no longer)."""
    steps = {}
    for share in ("0", "1"):
        out = tmp_path / f"sim{share}.json"
        assert main(["sim", *MODEL, "--exclusive", share, "--mem-gbps", "0.5", "--json",
                     str(out)]) == 0
        steps[share] = json.loads(out.read_text())["schedules"]["overlap"]["t_step_ms"]
    assert steps["1"] > steps["0"]


def test_cli_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    assert main(["sim", *MODEL, "--png", str(png)]) == 0
    assert png.stat().st_size > 0


def test_cli_sweep(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert main(["sim", *MODEL, "--sweep", "nodes=2,4", "outer_gbps=0.01,100", "--json", str(out),
                 "--png", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["nodes"], r["outer_gbps"]) for r in rows] == [(2, 0.01), (2, 100.0), (4, 0.01),
                                                             (4, 100.0)]
    for r in rows:
        assert r["t_serial_ms"] >= r["t_overlap_ms"] >= r["lower_bound_ms"] > 0
        assert r["line"].startswith(r["verdict"])
    slow, fast = rows[0], rows[1]
    assert slow["saving_ms"] > fast["saving_ms"]  # a slow outer link gains more
    printed = capsys.readouterr().out
    assert "nodes=2 outer_gbps=0.01: " in printed
    for name in ("sweep.png", "sweep_ms.png", "sweep_bound.png"):
        assert png.with_name(name).stat().st_size > 0
    with pytest.raises(SystemExit, match="bad --sweep"):
        main(["sim", *MODEL, "--sweep", "colour=red"])


def test_sim_imports_no_bench_module():
    root = Path(hsdp.__file__).parent
    for path in (root / "sim").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("hsdp_tools.bench") for n in names), (path, names)


def test_sweep_verdicts():
    """The reason given per row: host-bound, outer-bound, serialized rs stream behind the
    backward, or hidden either way."""
    from hsdp_tools.report.metrics import Interval
    from hsdp_tools.sim.engine import SimResult
    from hsdp_tools.sim.sweep import last_backward_ms, row

    def result(t_step, host, compute, rs, outer):
        ivs = [Interval("compute", "FWD:B", 0, 1000), Interval("compute", "BWD:B", 1000, 3000),
               Interval("compute", "COPY_IN:B/0", 3000, 3500)]
        metrics = {"busy_ms": {"by_kind": {"compute": compute, "inner_rs": rs, "outer": outer,
                                           "inner_ag": 1.0}},
                   "host_busy_ms": host, "lower_bound_ms": 1.0}
        return SimResult(ivs, metrics, t_step)

    setup = Setup(TINY_GPT, 2, 4)
    assert last_backward_ms(result(10, 0, 3, 1, 1)) == pytest.approx(2.5)
    cases = [((10, 10.0, 3, 1, 1), "host-bound"), ((10, 0, 3, 1, 4), "carries more"),
             ((10, 0, 5, 1, 2), "outlast"), ((10, 0, 5, 1, 1), "either way")]
    for args, reason in cases:
        r = row({"nodes": 2}, result(*args), result(args[0] + 1.0, *args[1:]), setup)
        assert reason in r["line"] and r["saving_ms"] == pytest.approx(1.0)
        assert r["verdict"] == "pays"  # 1 ms of 11


def test_real_nccl_busy_times_keep_the_unprofiled_waits(tmp_path):
    """On real NCCL the collectives' busy times are the unprofiled steps' (median per op,
    waits for the other ranks included: the simulator has no model of rank skew); only a
    run without them falls back to its trace less the waits."""
    from hsdp_tools.sim.calibrate import measured_busy_ms

    steps = [[["rs", "RS:Block0/0", ms], ["outer", "OUTER_AR:Block0/0", 2 * ms]]
             for ms in (1.0, 3.0, 2.0)]
    entry = {"metrics": {"busy_ms": {"by_kind": {"inner_rs": 1.5, "outer": 3.5}}},
             "side_ms_steps": steps}
    data = {"schedules": {"overlap": entry}}
    assert measured_busy_ms(tmp_path / "run.json", data, "overlap") == {"inner_rs": 2.0,
                                                                 "outer": 4.0}
    del entry["side_ms_steps"]  # no unprofiled steps and no trace: the traced busy times
    assert measured_busy_ms(tmp_path / "run.json", data, "overlap") == {"inner_rs": 1.5,
                                                                 "outer": 3.5}


# --------------------------------------------------------------------------- machine profile


def _profiled_run(tmp_path: Path, setup: Setup, **extra) -> Path:
    """A `bench step` JSON of ``setup`` with the trace of ``_llama_step`` beside it."""
    _write_trace(tmp_path / "trace_overlap.json.gz", _llama_step())
    return _bench_json(tmp_path, setup, {"compute": 50.0, **extra.pop("busy", {})},
                       trace="trace_overlap.json.gz", t_host_ms=2.5, **extra)


def _phase_ms(r, label: str) -> float:
    return sum(iv.end_us - iv.start_us for iv in r.intervals if iv.label == label) / 1e3


def test_profile_prices_another_setup_by_its_flops_and_ops(fake_world_8, tmp_path):
    """A profile turns the run's measured phases into rates: each block's forward at the
    run's TFLOP/s of that class on the FLOPs of the other setup (here twice the
    sequence), its host time per op on the ops the other setup issues."""
    setup = Setup(TINY_LLAMA, 2, 4)
    profile = calibrate_profile(_profiled_run(tmp_path, setup), machine="test")
    profile.save(tmp_path / "profile.json")
    assert MachineProfile.load(tmp_path / "profile.json") == profile

    def block_fwd(s: Setup) -> tuple[float, int]:
        """FLOPs and ops of one block's forward."""
        rec = record(s)
        ops = [op for op in rec.program.ops[rec.start:]
               if op.kind == "compute" and phase_class(op.label) == "FWD:LlamaBlock"]
        n = len({op.phase for op in ops})
        return sum(work_flops(op) for op in ops) / n, len(ops) // n

    flops, n_ops = block_fwd(setup)
    assert profile.class_tflops["FWD:LlamaBlock"] == pytest.approx(flops / 3e-3 / 1e12)
    assert profile.class_host_us["FWD:LlamaBlock"] == pytest.approx(500.0 / n_ops)
    longer = dataclasses.replace(setup, model=dataclasses.replace(TINY_LLAMA, seq=16))
    flops16, n16 = block_fwd(longer)
    assert flops16 > 2 * flops and n16 == n_ops
    r = simulate(longer, profile.cost_model(Fabric()))
    assert _phase_ms(r, "FWD:Block2") == pytest.approx(3.0 * flops16 / flops)
    # the run's own setup: the measured phases again
    assert _phase_ms(simulate(setup, profile.cost_model(Fabric())), "FWD:Block2") == (
        pytest.approx(3.0))


def test_collective_wait_follows_compute_not_the_link(fake_world_8, tmp_path):
    """What a collective takes beyond its modelled transfer is a wait in mean compute
    kernels (``comm_wait``): it reproduces the run's busy time, and on a 4x slower link
    it stays the same ms per op rather than growing with the transfer (``comm_scale``)."""
    setup = Setup(TINY_LLAMA, 2, 4)
    fabric = {"inner": {"bus_gbps": 370.0, "latency_us": 0.0},
              "outer": {"bus_gbps": 40.0, "latency_us": 0.0}}
    path = _profiled_run(tmp_path, setup, busy={"outer": 2.0})
    data = json.loads(path.read_text())
    data["meta"]["fabric"] = fabric
    path.write_text(json.dumps(data))
    profile = calibrate_profile(path)
    assert profile.comm_wait["outer"] > 0
    run_fabric = Fabric(Link(370.0, 0.0), Link(40.0, 0.0))
    slow = Fabric(Link(370.0, 0.0), Link(10.0, 0.0))
    rec = record(setup)

    def outer_ms(costs: CostModel) -> float:
        return evaluate(rec, costs).metrics["busy_ms"]["by_kind"]["outer"]

    assert outer_ms(profile.cost_model(run_fabric)) == pytest.approx(2.0)
    plain = dataclasses.replace(profile.cost_model(run_fabric), comm_wait={})
    extra = 2.0 - outer_ms(plain)
    assert extra > 0
    slow_plain = outer_ms(dataclasses.replace(plain, fabric=slow))
    assert outer_ms(profile.cost_model(slow)) == pytest.approx(slow_plain + extra)


def test_held_out_comparison_refuses_the_calibration_run(fake_world_8, tmp_path, monkeypatch):
    setup = Setup(TINY_LLAMA, 2, 4)
    path = _profiled_run(tmp_path, setup)
    profile = calibrate_profile(path)
    profile.save(tmp_path / "profile.json")
    other = tmp_path / "other" / "step.json"
    other.parent.mkdir()
    other.write_text(path.read_text())
    held_out(profile, [other])
    with pytest.raises(ValueError, match="calibrated on"):
        held_out(profile, [other, tmp_path / "." / "step.json"])
    script = Path(__file__).resolve().parents[2] / "scripts" / "sim_vs_measured.py"
    spec = importlib.util.spec_from_file_location("sim_vs_measured", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["sim_vs_measured.py", "--machine",
                                      str(tmp_path / "profile.json"), str(other), str(path),
                                      "--out", str(tmp_path / "page.md")])
    with pytest.raises(SystemExit, match="calibrated on"):
        module.main()
    assert not (tmp_path / "page.md").exists()


def _inner_all_gather_bytes(rec: Recording) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in rec.program.ops[rec.start:]:
        for kind, axis, nbytes, _ in op.payload if op.kind == "side" else ():
            if kind == "all_gather" and axis == "inner":
                name = re.sub(r"\d+/", "/", op.label.removeprefix("AG:"))
                out[name] = out.get(name, 0) + nbytes
    return out


def test_float8_all_gather_moves_one_byte_per_converted_weight_element(fake_world_8):
    """``--float8``: the blocks' and head's linears gather 1 byte per element, half their
    bf16 bytes (the norms stay bf16, in a group of their own); float8 matmuls run
    ``float8_speedup`` times faster."""
    pytest.importorskip("torchao.float8")
    cfg = LlamaConfig(vocab=48, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, seq=16)
    rec = record(Setup(cfg, 2, 4, float8=True))
    bf16 = _inner_all_gather_bytes(record(Setup(cfg, 2, 4)))
    f8 = _inner_all_gather_bytes(rec)
    h, kv = cfg.hidden, cfg.hidden // cfg.heads * cfg.kv_heads
    linears = 2 * h * h + 2 * h * kv + 3 * h * cfg.ffn  # per block
    norms = 2 * h
    gathers = bf16["LlamaBlock/0"] // (2 * cfg.layers * (linears + norms))
    assert gathers >= 1
    assert f8["LlamaBlock/1"] == gathers * cfg.layers * linears  # 1 byte per element
    assert f8["LlamaBlock/0"] == gathers * cfg.layers * norms * 2
    assert 2 * f8["LlamaBlock/1"] == bf16["LlamaBlock/0"] - f8["LlamaBlock/0"]
    assert 2 * f8["Float8Linear/0"] == bf16["Linear/0"]  # the head
    assert f8["Embedding/0"] == bf16["Embedding/0"]
    mm = next(op for op in rec.program.ops if op.kind == "compute"
              and op.payload.name == "aten::mm")
    slow, fast = CostModel(), CostModel(float8_speedup=2.0)
    assert fast.compute_seconds(mm) == pytest.approx(slow.compute_seconds(mm) / 2)


def test_diloco_period_is_timed_by_its_distinct_runs_of_steps():
    """Each step after which fragments sync, with the ``delay`` steps its all-reduce
    overlaps, and one quiet step standing for the rest; a delay reaching the next
    fragment's sync is refused."""
    from hsdp_tools.sim.engine import period_steps

    assert period_steps(None) == [(None, 1, 1)]
    assert period_steps(hsdp.DiLoCo(10)) == [(10, 1, 1), (1, 1, 9)]
    assert period_steps(hsdp.DiLoCo(50, 4, delay=5)) == [
        (12, 6, 1), (25, 6, 1), (37, 6, 1), (50, 6, 1), (6, 1, 26)]  # 50 wraps to 5
    with pytest.raises(ValueError, match="delay=2 overlaps the next fragment's sync"):
        Setup(TINY_LLAMA, 2, 4, outer_sync="diloco:inner_steps=8,fragments=4,delay=2")


def test_cli_refuses_diloco_fragments_that_do_not_divide_the_units():
    """A clear error before anything runs (once: the runtime's ValueError with a
    traceback from inside the fake world)."""
    with pytest.raises(SystemExit, match=r"^hsdp sim: DiLoCo fragments=4 does not divide the "
                       r"model's 5 fully_shard units \(the embedding, 2 blocks, the head and "
                       r"the root\); choose fragments among \[1, 5\]"):
        main(["sim", *MODEL, "--outer-sync", "diloco:inner_steps=8,fragments=4"])


def test_diloco_moves_the_outer_bytes_once_per_period_and_delay_hides_them(fake_world_8):
    """DiLoCo H=4: a quarter of synchronous hsdp's fp32 outer bytes per step (the fp32
    pseudo-gradient of the same shards, once per period); the period's mean is its runs
    weighted; on a slow outer link the all-reduce is exposed at delay 0 and hidden behind
    the next step's compute at delay 1."""
    costs = CostModel(Fabric(Link(FREE, 0.0), Link(1e-3, 0.0)), tflops=1e-4, mem_gbps=FREE)
    rec = record(Setup(TINY_LLAMA, 2, 4))
    assert len(rec.names) == Setup(TINY_LLAMA, 2, 4).units()  # what the fragments divide
    sync = evaluate(rec, costs)
    runs = {d: evaluate(record(Setup(TINY_LLAMA, 2, 4, outer_sync=f"diloco:inner_steps=4,"
                                     f"fragments=2,delay={d}")), costs) for d in (0, 1)}
    for r in runs.values():
        assert r.metrics["outer_bytes_per_step"] * 4 == sync.metrics["outer_bytes_per_step"]
    now = runs[0].metrics["period_runs_ms"]  # syncs after steps 2 and 4; 1 and 3 quiet
    assert runs[0].t_step_ms == pytest.approx((now[0] + now[1] + 2 * now[2]) / 4)
    assert min(now[:2]) > 1.5 * now[2]  # each sync step waits for its all-reduce
    later = runs[1].metrics["period_runs_ms"]  # steps 2-3 and 4-1, back to back
    assert len(later) == 2 and runs[1].t_step_ms == pytest.approx(sum(later) / 4)
    assert runs[1].t_step_ms < runs[0].t_step_ms
