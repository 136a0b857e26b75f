"""The CUDA path on one GPU (skipped without CUDA): real NCCL at world size 1, and the
schedule on named streams under a fake 2x4 world with emulated collective durations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HERE = Path(__file__).resolve().parent


def _child(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1] / "src"), NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    out = subprocess.run([sys.executable, str(HERE / "cuda_child.py"), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(args, result)
    return result


def test_world_size_1_matches_reference():
    errs = _child("world1")
    assert errs and all(e < 1e-5 for e in errs.values()), errs


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_outer_runs_on_its_own_stream_and_overlaps_previous_rs(strategy):
    r = _child("trace", strategy)
    assert abs(r["calibration_error"]) < 0.05
    assert r["rs_streams"] == ["rs"] and r["outer_streams"] == ["outer"]
    assert r["n_outer"] == r["n_rs"] > 2
    assert r["outer_overlapping_next_rs"] >= 1, r
    assert r["comm_comm_overlap_ms"] > 0
    # The rs stream never waits on outer; compute waits on outer only in the finalize,
    # i.e. after the last outer reduction was issued (end of backward).
    assert r["rs_waits_on_outer"] == 0, r
    assert r["compute_waits_on_outer"] >= r["n_outer"], r
    assert r["compute_waits_on_outer_before_last_outer_issue"] == 0, r


def test_peak_memory_grows_only_by_sharded_state():
    small, big = _child("memory", "8"), _child("memory", "16")
    unit = 4096 * 4096 * 4
    # hsdp on 2x4: main weights, grad accumulation, momentum: 1/4 of a unit each.
    assert big["peak"] - small["peak"] <= 8 * unit * 3 / 4 + unit
    assert big["steady"] - small["steady"] <= 8 * unit * 3 / 4 + unit


def test_checkpoint_save_and_load_with_nccl(tmp_path):
    """hsdp.save (sync and async) and hsdp.load on CUDA with NCCL at world size 1: the
    loaded model and AdamW state equal the saved ones (bench ckpt's check, small model)."""
    out = tmp_path / "ckpt.json"
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1] / "src"), NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    run = subprocess.run(
        [sys.executable, "-m", "hsdp", "bench", "ckpt", "--device", "cuda", "--nproc", "1",
         "--model", "gpt", "--layers", "2", "--set", "hidden=256", "--set", "heads=4",
         "--set", "ffn=512", "--set", "vocab=1024", "--set", "seq=128", "--repeats", "1",
         "--dir", str(tmp_path / "d"), "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(out.read_text())["load_equal"]


def test_compute_waits_for_emulated_delay_through_work_handles():
    """Megatron-FSDP waits its all-gathers through work handles, which the fake process
    group completes at once: under emulation compute must still wait for the delay."""
    r = _child("intercept")
    for how in ("coalesced", "plain"):
        assert r[f"{how}_delayed_ms"] >= 19.0, r  # the 20 ms emulated delay
        assert r[f"{how}_free_ms"] < 5.0, r


def test_traced_side_ops_report_their_stream_time_and_host_span():
    """With the tracer on, each side op's time on its stream (timing events around its
    work, after its inputs are ready) and its host span: the simulator's calibration."""
    from hsdp.streams.stream_set import Streams
    from hsdp_tools.bench.emulate import SleepClock
    from hsdp_tools.bench.trace import host_marks

    clock = SleepClock.calibrate(torch.device("cuda", 0))
    s = Streams.create(torch.device("cuda", 0))
    s.tracer.enabled = True
    ready = s.compute.record()
    s.ag.submit(lambda: clock(0.02), [ready], "AG:x/0")
    torch.cuda.synchronize()
    s.tracer.enabled = False
    (stream, label, ms), = s.tracer.side_ms()
    assert (stream, label) == ("ag", "AG:x/0") and 19.0 <= ms < 40.0
    marks = host_marks(s.tracer.take(), 0.0)
    assert [m[1] for m in marks] == ["hsdp:ag:AG:x/0"] and marks[0][3] > 0


def test_phase_marks_report_when_the_compute_stream_reached_them():
    """With the tracer on, each compute phase mark also records when the device got there:
    behind a 20 ms kernel, the device reaches the end mark 20 ms after the begin mark,
    while the host had passed both at once."""
    from hsdp.streams.stream_set import Streams
    from hsdp_tools.bench.emulate import SleepClock

    clock = SleepClock.calibrate(torch.device("cuda", 0))
    s = Streams.create(torch.device("cuda", 0))
    s.tracer.enabled = True
    s.compute.begin("FWD:x")
    clock(0.02)
    s.compute.end("FWD:x")
    torch.cuda.synchronize()
    s.tracer.enabled = False
    (begin, zero), (end, ms) = s.tracer.device_marks()
    assert (begin, end, zero) == ("hsdp.begin:FWD:x", "hsdp.end:FWD:x", 0.0)
    assert 19.0 <= ms < 40.0
    assert s.tracer.device_marks() == []  # read once


def test_side_stream_submit_runs_there_and_restores_the_callers_stream_and_device():
    """A side op runs on its stream; the caller's current stream (any, not only the
    default) and current device are as they were afterwards, also when the caller's
    current device is another GPU than hsdp's."""
    from hsdp.streams.stream_set import Streams

    s = Streams.create(torch.device("cuda", 0))
    seen = []
    mine = torch.cuda.Stream(0)
    with torch.cuda.stream(mine):
        s.ag.submit(lambda: seen.append(torch.cuda.current_stream(0)), [], "AG:x/0")
        assert torch.cuda.current_stream(0) == mine
    assert seen == [s.ag.stream] and torch.cuda.current_stream(0) == torch.cuda.default_stream(0)
    if torch.cuda.device_count() > 1:
        torch.cuda.set_device(1)
        try:
            s.rs.submit(lambda: seen.append(torch.cuda.current_stream(0)), [], "RS:x/0")
            assert torch.cuda.current_device() == 1 and seen[-1] == s.rs.stream
        finally:
            torch.cuda.set_device(0)
    s.ag.submit(lambda: None, [s.compute.record()]).synchronize()


def test_alloc_retries_count_a_cache_flush():
    """bench step's memory-pressure flag: an allocation that fits only once the cache is
    freed is a retry (a cached block of 40 % of free memory, then one of 70 %)."""
    from hsdp_tools.bench.step import allocator_retries
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0]
    before = allocator_retries(device)
    block = torch.empty(int(free * 0.4), dtype=torch.uint8, device=device)
    del block  # cached, not returned to the driver
    assert allocator_retries(device) == before
    block = torch.empty(int(free * 0.7), dtype=torch.uint8, device=device)
    del block
    torch.cuda.empty_cache()
    assert allocator_retries(device) == before + 1
