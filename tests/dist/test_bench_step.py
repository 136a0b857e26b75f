"""bench step / demo: fabric fitting, options, and real runs on tiny models (4 gloo ranks;
one process emulating a 2x4 mesh). Shapes and sanity of the results only, never speed."""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsdp_tools.cli import COMMANDS, build_parser
from hsdp_tools.bench.step_config import fabric_from_collectives, parse_schedules, resolve
from hsdp_tools.bench.step_results import print_table
from hsdp_tools.report.compare import compare
from hsdp_tools.models import GPTConfig, LlamaConfig
from hsdp_tools.sim.tp_pricing import unit_collectives
from hsdp_tools.sim.fabric import Fabric, Link

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--ffn", "64", "--vocab", "64",
        "--seq", "16", "--steps", "2", "--warmup", "1"]
METRICS = ("exposed_comm_ms", "outer_tail_ms", "comm_comm_overlap_ms", "lower_bound_ms")


def bench_step(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # spawn its own ranks, as outside torchrun
    argv = ("--device", "cpu", *argv)  # the CPU path (gloo ranks) on any machine
    return subprocess.run([sys.executable, "-m", "hsdp", "bench", "step", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout)


def check_result(path: Path, out_dir: Path, schedules: list[str], recorded: int = 3,
                 traced: int = 2) -> dict:
    """The JSON's shape; ``recorded`` / ``traced``: the steps recorded without the
    profiler (hsdp's host marks of each) and the profiled steps (a trace each)."""
    result = json.loads(path.read_text())
    meta = result["meta"]
    for key in ("hardware", "torch", "nccl", "mesh", "emulate", "fabric",
                "calibration_error", "model", "num_params", "date"):
        assert key in meta, key
    assert meta["num_params"] > 0 and meta["model"]["layers"] == 2
    assert list(result["schedules"]) == schedules
    for name, s in result["schedules"].items():
        lo, mid, hi = s["t_step_min_ms"], s["t_step_ms"], s["t_step_max_ms"]
        assert 0 < lo <= mid <= hi and math.isfinite(hi), (name, s)
        assert len(s["t_step_samples_ms"]) == 2
        assert s["tokens_per_s"] > 0 and math.isfinite(s["tokens_per_s"])
        assert 0 < s["t_host_min_ms"] <= s["t_host_ms"] <= s["t_host_max_ms"]
        assert s["peak_mem_bytes"] is None and s["peak_mem_phase_bytes"] is None  # CPU
        assert s["alloc_retry_steps"] is None
        for key in METRICS:  # fsdp2 included: its collectives are wrapped and traced
            assert s[key] >= 0 and math.isfinite(s[key]), (name, key, s[key])
        assert s["lower_bound_ms"] > 0
        # the bound and the step it is of (the profiled one), never above it
        assert 0 < s["lower_bound_ms"] <= s["traced_step_ms"] + 1e-9, (name, s)
        assert s["traced_step_ms"] == s["metrics"]["span_ms"]
        assert s["traces"][0] == s["trace"] and len(s["traces"]) == traced
        assert [Path(t).name for t in s["traces"]] == [
            f"trace_{name}{f'.{k}' if k > 1 else ''}.json.gz" for k in range(1, traced + 1)]
        assert all(Path(t).is_file() for t in s["traces"])
        if s["library"] == "hsdp":  # each recorded step's phase marks (CPU: no submits)
            assert len(s["host_marks_steps"]) == recorded
            for marks in s["host_marks_steps"]:
                begins = [name.rstrip("0123456789") for _, name, _, _ in marks
                          if name.startswith("hsdp.begin:")]
                assert begins.count("hsdp.begin:OPTIMIZER:Llama") == 1, begins
                assert begins.count("hsdp.begin:FWD:LlamaBlock") == 2 * meta["model"][
                    "microbatches"]  # 2 layers
            assert s["side_ms_steps"] == [[]] * recorded  # timing events on GPU only
            assert s["device_marks_steps"] is None
        else:
            assert s["host_marks_steps"] is None and s["side_ms_steps"] is None
            assert s["device_marks_steps"] is None
        world = meta["mesh"]["world"]
        others = s["other_ranks"]  # ranks 1..: their own host times and recorded steps
        assert len(others) == (0 if meta["emulate"] else world - 1)
        for other in others:
            assert len(other["t_host_samples_ms"]) == 2 and min(other["t_host_samples_ms"]) > 0
            assert other["device_marks_steps"] is None  # timing events on GPU only
            if s["library"] == "hsdp":
                assert len(other["host_marks_steps"]) == recorded
                assert [[n for _, n, _, _ in m] for m in other["host_marks_steps"]] == [
                    [n for _, n, _, _ in m] for m in s["host_marks_steps"]]  # same program
            else:
                assert other["host_marks_steps"] is None
        by_kind = s["metrics"]["busy_ms"]["by_kind"]
        assert by_kind["compute"] > 0 and by_kind["inner"] > 0 and by_kind["outer"] > 0
    assert (out_dir / "timeline.png").stat().st_size > 0
    return result


def check_output(proc: subprocess.CompletedProcess) -> None:
    """A progress line per phase, where the files went, no profiler start/stop lines."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    for phase in ("built", "warm-up:", "timed:", "recorded:", "traced:"):
        assert f"bench step: {phase}" in proc.stderr, phase
    assert "profiler_start" not in proc.stderr + proc.stdout
    assert "timeline.png" in proc.stdout and "trace_<schedule>.json.gz" in proc.stdout


@pytest.mark.full
def test_gloo_ranks(tmp_path, capsys):
    out = tmp_path / "step.json"
    proc = bench_step("--nproc", "4", "--mesh", "2x2", *TINY, "--json", str(out),
                      "--out-dir", str(tmp_path / "traces"))
    check_output(proc)
    assert "overlap vs serial" in proc.stdout and "overlap vs fsdp2" in proc.stdout
    result = check_result(out, tmp_path / "traces", ["overlap", "serial", "fsdp2"])
    meta = result["meta"]
    assert meta["mesh"] == {"outer": 2, "inner": 2, "tp": 1, "world": 4}
    assert meta["backend"] == "gloo" and meta["emulate"] is False and meta["fabric"] is None
    assert meta["model"]["dtype"] == "fp32"
    assert set(result["summary"]) == {"overlap_vs_serial", "overlap_vs_fsdp2"}
    assert result["reference"] is None  # the collective-free step needs --emulate
    assert all(s["t_free_ms"] is None for s in result["schedules"].values())
    assert "memory pressure" not in proc.stdout
    # a GPU run whose timed steps hit the allocator's retry says so under the table
    result["schedules"]["serial"]["alloc_retry_steps"] = 1
    print_table(result)
    assert ("memory pressure: the caching allocator freed its cache and retried (a device "
            "synchronization) in 1 of 2 timed steps of serial") in " ".join(
                capsys.readouterr().out.split())


def test_emulated_mesh(tmp_path):
    out = tmp_path / "step.json"
    schedules = ["overlap", "serial", "hfsdp", "fsdp2"]
    proc = bench_step("--emulate", "--mesh", "2x4", *TINY, "--microbatches", "2",
                      "--schedules", ",".join(schedules), "--record-steps", "2",
                      "--trace-steps", "1", "--json", str(out),
                      "--out-dir", str(tmp_path / "traces"))
    check_output(proc)
    assert "bench step: collective-free:" in proc.stderr
    result = check_result(out, tmp_path / "traces", schedules, recorded=2, traced=1)
    ref = result["reference"]
    assert ref["name"] == "unsharded" and 0 < ref["t_step_min_ms"] <= ref["t_step_ms"]
    for s in result["schedules"].values():  # every schedule's collective-free step
        assert 0 < s["t_free_min_ms"] <= s["t_free_ms"] <= s["t_free_max_ms"]
        assert s["free_over_unsharded"] == pytest.approx(s["t_free_ms"] / ref["t_step_ms"])
    meta = result["meta"]
    assert meta["emulate"] is True and meta["backend"] == "fake"
    assert meta["mesh"] == {"outer": 2, "inner": 4, "tp": 1, "world": 8}
    assert meta["fabric"]["inner"]["bus_gbps"] == 370.0
    assert meta["fabric"]["outer"]["latency_us"] == 20.0
    assert meta["global_tokens_per_step"] == 8 * 2 * 16 * 2
    assert meta["record_steps"] == 2 and meta["trace_steps"] == 1


def test_emulated_compressed_outer_reduction(tmp_path):
    """``--outer-reduce int8:16``: overlap-q and hfsdp-q exchange one byte per element
    (plus a 4-byte scale per 16) over outer by all-to-all, where overlap all-reduces fp32."""
    out = tmp_path / "step.json"
    schedules = ["overlap", "overlap-q", "hfsdp-q"]
    proc = bench_step("--emulate", "--mesh", "2x4", *TINY, "--schedules", ",".join(schedules),
                      "--outer-reduce", "int8:16", "--record-steps", "1", "--trace-steps", "1",
                      "--run-steps", "2", "--json", str(out),
                      "--out-dir", str(tmp_path / "traces"))
    check_output(proc)
    result = check_result(out, tmp_path / "traces", schedules, recorded=1, traced=1)
    # --run-steps: each schedule's steps back to back, a column of the table
    assert "bench step: back to back: 2 steps" in proc.stderr and "back-to-back" in proc.stdout
    assert result["meta"]["run_steps"] == 2
    assert all(s["t_run_ms"] > 0 for s in result["schedules"].values())
    assert result["meta"]["outer_reduce"] == {"dtype": "int8", "block": 16,
                                              "error_feedback": True}
    nbytes = {n: s["collective_bytes_per_step"] for n, s in result["schedules"].items()}
    exact = nbytes["overlap"]["all_reduce:outer"]
    for name in ("overlap-q", "hfsdp-q"):
        assert "all_reduce:outer" not in nbytes[name] and "reduce_scatter:outer" not in nbytes[
            name]
        assert 1.25 / 4 <= nbytes[name]["all_to_all:outer"] / exact < 0.4, nbytes
    assert nbytes["overlap-q"]["all_gather:outer"] == nbytes["overlap-q"]["all_to_all:outer"]


@pytest.mark.full
def test_emulated_tp(tmp_path):
    """--tp 2 on an emulated 2x2 mesh: a 2x2x2 world whose every schedule issues the TP
    collectives of torch's plan, by the bytes a hand count gives, delayed on compute."""
    out = tmp_path / "step.json"
    schedules = ["overlap", "hfsdp", "fsdp2"]
    proc = bench_step("--emulate", "--mesh", "2x2", "--tp", "2", *TINY, "--schedules",
                      ",".join(schedules), "--record-steps", "1", "--trace-steps", "1",
                      "--json", str(out), "--out-dir", str(tmp_path / "traces"))
    check_output(proc)
    assert "mesh 2x2x2 (outer x inner x tp) emulated" in " ".join(proc.stdout.split())
    result = check_result(out, tmp_path / "traces", schedules, recorded=1, traced=1)
    meta = result["meta"]
    assert meta["mesh"] == {"outer": 2, "inner": 2, "tp": 2, "world": 8}
    assert meta["fabric"]["tp"] == {"bus_gbps": 370.0, "latency_us": 20.0}
    assert meta["global_tokens_per_step"] == 4 * 2 * 16  # dp ranks x mbs x seq
    m = meta["model"]
    layers, vocab, h = m["layers"], m["vocab"], m["hidden"]
    act = m["mbs"] * m["seq"] * h * 4  # one sequence-parallel activation, fp32, whole
    want = {  # per block: forward AG + RS around attention and the MLP, backward mirrored
        # (+ the embedding's RS, the head's AG of its input and of the logits)
        "all_gather:tp": (4 * layers + 2) * act + m["mbs"] * m["seq"] * vocab * 4,
        "reduce_scatter:tp": (2 * layers + 2) * act,
        # input gradients of the 5 colwise linears per block (Partial -> Replicate) and
        # the sequence-parallel norm weights' gradients
        "all_reduce:tp": 5 * layers * act + (2 * layers + 1) * h * 4,
    }
    sim = {}  # hsdp sim's table: what it prices on compute
    count = {"LlamaBlock": layers, "Embedding": 1, "Linear": 1, "Llama": 1}
    for cls, colls in unit_collectives(LlamaConfig(**{
            k: m[k] for k in ("vocab", "hidden", "heads", "kv_heads", "ffn", "layers",
                              "seq")}), m["mbs"], 4).items():
        if not cls.startswith("RECOMPUTE"):
            for kind, n in colls:
                sim[f"{kind}:tp"] = sim.get(f"{kind}:tp", 0) + count[cls.split(":")[1]] * n
    assert sim == want
    for s in result["schedules"].values():
        got = {k: v for k, v in s["collective_bytes_per_step"].items() if k.endswith(":tp")}
        assert got == want, (got, want)


def test_tp_options_are_checked():
    parser = build_parser()

    def cfg(*argv: str, world: int | None = 8):
        return resolve(parser.parse_args(["bench", "step", *argv]), False, world)

    c = cfg("--tp", "2")
    assert (c.outer, c.inner, c.tp, c.world) == (2, 2, 2, 8)
    assert cfg("--emulate", "--tp", "4", world=None).world == 2 * 4 * 4
    for argv, msg in ((("--tp", "3"), "--tp 3 does not divide the job's 8 ranks"),
                      (("--tp", "2", "--mesh", "2x4"), r"OUTER\*INNER\*TP = 8"),
                      (("--tp", "2", "--arch", "gpt"), "for --arch llama only"),
                      (("--tp", "0"), "--tp must be at least 1")):
        with pytest.raises(SystemExit, match=msg):
            cfg(*argv)


@pytest.mark.full
def test_missing_or_unsupported_peer_is_a_clear_error():
    proc = bench_step("--emulate", "--mesh", "2x2", *TINY, "--schedules", "overlap,mfsdp",
                      timeout=60)
    assert proc.returncode != 0
    try:
        import megatron_fsdp  # noqa: F401
    except ImportError:
        assert "needs Megatron-FSDP, which is not installed" in proc.stderr, proc.stderr
        assert "pip install 'hsdp[mfsdp]'" in proc.stderr
    else:
        assert "Megatron-FSDP runs on CUDA only" in proc.stderr, proc.stderr


def test_compare_flags_overlapping_ranges_as_noise():
    def entry(lo: float, mid: float, hi: float) -> dict:
        return {"t_step_ms": mid, "t_step_min_ms": lo, "t_step_max_ms": hi,
                "t_step_samples_ms": [lo, mid, mid, mid, hi]}

    clear = compare(entry(8, 9, 10), entry(11, 12, 13))
    assert clear["ratio"] == pytest.approx(0.75) and clear["saving_ms"] == pytest.approx(3)
    assert clear["saving_pct"] == pytest.approx(25) and not clear["within_noise"]
    assert compare(entry(8, 9, 11), entry(11, 12, 13))["within_noise"]
    assert compare(entry(11, 12, 13), entry(8, 9, 11.5))["within_noise"]


@pytest.mark.full
def test_mesh_not_matching_world_is_a_clear_error():
    proc = bench_step("--nproc", "4", "--mesh", "2x3", *TINY, timeout=60)
    assert proc.returncode != 0
    assert "mesh 2x3 has 6 ranks but the job has 4" in proc.stderr


def test_fabric_from_collectives_fits_latency_and_bandwidth(tmp_path):
    true = Fabric(Link(150.0, 12.0), Link(20.0, 35.0))  # what the "measurements" follow
    sizes = [1 << 20, 16 << 20, 256 << 20]
    rows = [{"size_bytes": b, "t_rs_ms": 1e3 * true.seconds("reduce_scatter", "inner", b, 4),
             "t_ar_ms": 1e3 * true.seconds("all_reduce", "outer", b // 4, 2)} for b in sizes]
    path = tmp_path / "collectives.json"
    path.write_text(json.dumps({"meta": {"outer": 2, "inner": 4}, "rows": rows}))
    flags = Fabric(Link(370.0, 20.0), Link(47.0, 20.0))
    fabric, err = fabric_from_collectives(path, flags)
    for link, want in ((fabric.inner, true.inner), (fabric.outer, true.outer)):
        assert link.bus_gbps == pytest.approx(want.bus_gbps, rel=1e-6)
        assert link.latency_us == pytest.approx(want.latency_us, rel=1e-6)
    assert err["inner"] < 1e-9 and err["outer"] < 1e-9
    # one rank on an axis: nothing measured there, the flags' link is kept
    path.write_text(json.dumps({"meta": {"outer": 1, "inner": 4}, "rows": rows}))
    fabric, err = fabric_from_collectives(path, flags)
    assert fabric.outer == flags.outer and err["outer"] is None
    assert fabric.inner.bus_gbps == pytest.approx(150.0, rel=1e-6)
    path.write_text(json.dumps({"meta": {"outer": 1, "inner": 1}, "rows": rows}))
    with pytest.raises(SystemExit, match="no group of two or more ranks"):
        fabric_from_collectives(path, flags)


def test_options_and_registration():
    assert COMMANDS[("bench", "step")] == "hsdp_tools.bench.step"
    assert COMMANDS[("demo",)] == "hsdp_tools.demo"
    assert parse_schedules("overlap, fsdp2") == ("overlap", "fsdp2")
    for bad in ("overlap,overlap", "ddp", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_schedules(bad)
    parser = build_parser()
    step = parser.parse_args(["bench", "step"])
    demo = parser.parse_args(["demo"])
    assert step.schedules == ("overlap", "serial", "fsdp2")
    assert demo.schedules == step.schedules and demo.steps < step.steps
    assert demo.record_steps == demo.trace_steps == 1  # nothing to calibrate
    assert demo.model_defaults["cpu"]["hidden"] <= step.model_defaults["cpu"]["hidden"]


def test_default_model_is_llama_style():
    parser = build_parser()

    def cfg(*argv: str, cuda: bool = False):
        return resolve(parser.parse_args(["bench", "step", *argv]), cuda, 4)

    assert cfg(cuda=True).model == LlamaConfig(vocab=32768, hidden=4096, heads=32, kv_heads=8,
                                               ffn=14336, layers=8, seq=2048)
    small = cfg("--layers", "2", "--kv-heads", "1").model
    assert isinstance(small, LlamaConfig) and small.layers == 2 and small.kv_heads == 1
    assert isinstance(cfg("--arch", "gpt").model, GPTConfig)
    with pytest.raises(SystemExit, match="--kv-heads applies to --arch llama"):
        cfg("--arch", "gpt", "--kv-heads", "2")
    with pytest.raises(SystemExit, match="not a multiple of kv_heads"):
        cfg("--heads", "4", "--kv-heads", "3")
    assert (cfg().record_steps, cfg().trace_steps) == (3, 2)
    for flag in ("--record-steps", "--trace-steps"):
        with pytest.raises(SystemExit, match=f"{flag} >= 1"):
            cfg(flag, "0")


def test_tp_plan_equals_one_process():
    """The bench's TP plan on (outer, inner, tp) = (1, 2, 2) under hsdp, hfsdp and FSDP2:
    parameters after 3 SGD-with-momentum steps equal one process's (fp32, 1e-5); a TP
    group's ranks get the same batches, data-parallel ranks different ones."""
    from bench_tp_jobs import parity_job
    from dist_utils import run_ranks

    for r in run_ranks(parity_job, 4, (1, 2, 2)):
        assert all(e < 1e-5 for e in r["errs"].values()), r["errs"]
        assert r["batches"] == (True, True)
