"""Intervals from CPU OpRecords and from a synthetic torch.profiler Chrome trace."""

import gzip
import json
import time
from pathlib import Path

import pytest
import torch

from hsdp.streams.contract import OpRecord, Tracer
from hsdp.streams.stream_set import Streams
from hsdp_tools.bench.trace import host_marks, intervals_from_chrome_trace, intervals_from_records
from hsdp_tools.report.chrome_trace import load_chrome_trace
from hsdp_tools.report.metrics import Interval, intersect, step_metrics, total


def spans(ivs: list[Interval]) -> list[tuple]:
    return [(iv.stream, iv.label, pytest.approx(iv.start_us), pytest.approx(iv.end_us))
            for iv in ivs]


def times(ivs: list[Interval]) -> list[float]:
    return [t for iv in ivs for t in (iv.start_us, iv.end_us)]


# --------------------------------------------------------------------------- CPU records

RECORDS = [
    OpRecord("rs", "RS:a", 10.001, 10.003),
    OpRecord("outer", "OUTER_AR:a", 10.002, 10.006),
    OpRecord("compute", "wait:ag", 10.0005, 10.001),
    OpRecord("compute", "wait:finalize", 10.004, 10.006),
    OpRecord("compute", "wait:nested", 10.0045, 10.005),
    OpRecord("compute", "fwd", 10.0, 10.0005),  # already busy in the complement
]


def test_records_compute_is_the_complement_of_waits():
    ivs = intervals_from_records(RECORDS, t0=10.0)
    assert [(iv.stream, iv.label) for iv in ivs] == [
        ("compute", "compute"), ("compute", "compute"), ("rs", "RS:a"),
        ("outer", "OUTER_AR:a")]
    assert times(ivs) == pytest.approx([0, 500, 1000, 4000, 1000, 3000, 2000, 6000])
    m = step_metrics(ivs)
    assert m["exposed_comm_ms"] == pytest.approx(2.0)  # [4000, 6000]
    assert m["outer_tail_ms"] == pytest.approx(2.0)
    assert m["comm_comm_overlap_ms"] == pytest.approx(1.0)


def test_records_explicit_end_extends_compute():
    ivs = intervals_from_records(RECORDS, t0=10.0, t1=10.008)
    compute = [iv for iv in ivs if iv.stream == "compute"]
    assert times(compute) == pytest.approx([0, 500, 1000, 4000, 6000, 8000])


def test_records_empty():
    assert intervals_from_records([], t0=1.0) == []


# --------------------------------------------------------------------------- Chrome trace

HOST, OTHER_HOST = (1, 10), (1, 11)


def host(cat: str, name: str, ts: float, dur: float, corr: int | None = None,
         thread: tuple = HOST) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "pid": thread[0], "tid": thread[1], "ts": ts,
         "dur": dur, "args": {}}
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def gpu(cat: str, name: str, ts: float, dur: float, corr: int, stream: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts,
            "dur": dur, "args": {"correlation": corr, "stream": stream, "device": 0}}


TRACE = {"traceEvents": [
    host("user_annotation", "## forward ##", 0, 1000),  # not hsdp: ignored
    host("cuda_runtime", "cudaLaunchKernel", 50, 2, corr=6),
    gpu("kernel", "gemm", 60, 100, 6, stream=7),
    # RS: a memset and a kernel, launched inside its annotation
    host("user_annotation", "hsdp:rs:RS:blocks.1", 100, 20),
    host("cuda_runtime", "cudaLaunchKernel", 105, 2, corr=1),
    gpu("kernel", "ncclDevKernel_ReduceScatter", 200, 50, 1, stream=20),
    host("cuda_runtime", "cudaMemsetAsync", 110, 2, corr=2),
    gpu("gpu_memset", "Memset (Device)", 190, 5, 2, stream=20),
    # a launch on another host thread at the same time is not the RS's
    host("cuda_runtime", "cudaLaunchKernel", 105, 2, corr=9, thread=OTHER_HOST),
    gpu("kernel", "other_thread", 400, 10, 9, stream=7),
    # outer AR launched through the driver API
    host("user_annotation", "hsdp:outer:OUTER_AR:blocks.1", 130, 10),
    host("cuda_driver", "cuLaunchKernelEx", 132, 2, corr=3),
    gpu("kernel", "ncclDevKernel_AllReduce", 210, 100, 3, stream=30),
    # nested annotations: a launch belongs to the innermost
    host("user_annotation", "hsdp:ag:AG:blocks.0", 150, 30),
    host("user_annotation", "hsdp:ag:FREE:x", 160, 5),
    host("cuda_runtime", "cudaMemsetAsync", 162, 1, corr=4),
    gpu("gpu_memset", "Memset (Device)", 290, 2, 4, stream=40),
    host("cuda_runtime", "cudaLaunchKernel", 170, 2, corr=5),
    gpu("kernel", "ncclDevKernel_AllGather", 300, 10, 5, stream=40),
    # outside every hsdp op: compute on stream 7, dropped on hsdp stream 20
    host("cuda_runtime", "cudaLaunchKernel", 190, 2, corr=7),
    gpu("kernel", "elementwise", 320, 30, 7, stream=7),
    host("cuda_runtime", "cudaLaunchKernel", 195, 2, corr=8),
    gpu("kernel", "copy_on_rs_stream", 360, 5, 8, stream=20),
    # a GPU event whose launch is not in the trace
    gpu("gpu_memcpy", "Memcpy DtoD", 500, 5, 10, stream=8),
    # the same op in a later step is a second interval
    host("user_annotation", "hsdp:rs:RS:blocks.1", 600, 10),
    host("cuda_runtime", "cudaLaunchKernel", 605, 2, corr=11),
    gpu("kernel", "ncclDevKernel_ReduceScatter", 700, 20, 11, stream=20),
    # noise: GPU-lane annotations and flow events
    {"ph": "X", "cat": "gpu_user_annotation", "name": "hsdp:rs:RS:blocks.1", "pid": 0,
     "tid": 20, "ts": 190, "dur": 60, "args": {}},
    {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 1, "tid": 10, "ts": 105},
]}

EXPECTED = [
    ("compute", "gemm", 60, 160),
    ("rs", "RS:blocks.1", 190, 250),
    ("outer", "OUTER_AR:blocks.1", 210, 310),
    ("ag", "FREE:x", 290, 292),
    ("ag", "AG:blocks.0", 300, 310),
    ("compute", "elementwise", 320, 350),
    ("compute", "other_thread", 400, 410),
    ("compute", "Memcpy DtoD", 500, 505),
    ("rs", "RS:blocks.1", 700, 720),
]


def test_chrome_trace_maps_gpu_events_to_hsdp_ops():
    assert spans(intervals_from_chrome_trace(TRACE)) == EXPECTED


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_chrome_trace_from_file(tmp_path, name):
    path = tmp_path / name
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(TRACE, f)
    assert spans(intervals_from_chrome_trace(path)) == EXPECTED
    assert spans(intervals_from_chrome_trace(str(path))) == EXPECTED


def test_chrome_trace_metrics():
    m = step_metrics(intervals_from_chrome_trace(TRACE), window=(0, 400))
    # inner: [190,250] + [290,292] is FREE (other) + [300,310]; outer: [210,310]
    assert m["busy_ms"]["by_kind"]["inner"] == pytest.approx(0.07)
    assert m["comm_comm_overlap_ms"] == pytest.approx(0.05)  # [210,250] + [300,310]
    # comm [190,310] minus compute [60,160] + [320,350]
    assert m["exposed_comm_ms"] == pytest.approx(0.12)
    # last outer ends at 310; last compute starting before it ends at 160
    assert m["outer_tail_ms"] == pytest.approx(0.15)


def test_chrome_trace_empty():
    assert intervals_from_chrome_trace({"traceEvents": []}) == []
    assert intervals_from_chrome_trace({}) == []


# --------------------------------------------------------------------------- real trace

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("name", ["serial", "overlap"])
def test_real_trace_matches_kineto_gpu_annotation_spans(name):
    """A torch 2.11 / H200 trace: our op spans equal Kineto's own GPU-side annotations."""
    path = DATA / f"trace_h200_torch211_{name}.json.gz"
    ivs = intervals_from_chrome_trace(path)
    events = load_chrome_trace(path)["traceEvents"]
    kineto = sorted((e["name"].split(":", 1)[1], e["ts"], e["ts"] + e["dur"])
                    for e in events if e["cat"] == "gpu_user_annotation")
    ours = sorted((f"{iv.stream}:{iv.label}", iv.start_us, iv.end_us)
                  for iv in ivs if iv.stream != "compute")
    assert [n for n, _, _ in ours] == [n for n, _, _ in kineto] == [
        "ag:AG:y", "outer:OUTER_AR:x" if name == "overlap" else "rs:OUTER_AR:x", "rs:RS:x"]
    for (_, lo, hi), (_, klo, khi) in zip(ours, kineto, strict=True):
        assert lo == pytest.approx(klo, abs=0.01) and hi == pytest.approx(khi, abs=0.01)
    gemms = [e for e in events if e["cat"] == "kernel" and "gemm" in e["name"]]
    assert sorted(iv.start_us for iv in ivs if iv.stream == "compute") == sorted(
        e["ts"] for e in gemms)
    m = step_metrics(ivs)
    assert m["busy_ms"]["by_kind"]["outer"] == pytest.approx(1.449, abs=0.01)
    assert ("outer" in m["busy_ms"]["by_stream"]) == (name == "overlap")


def test_records_from_cpu_streams_tracer():
    """The CPU runtime's own records: compute waits on rs become idle compute time."""
    tracer = Tracer(enabled=True)
    s = Streams.create(torch.device("cpu"), tracer)
    t0 = time.perf_counter()
    s.compute.wait(s.rs.submit(lambda: time.sleep(0.01), label="RS:x"))
    records = tracer.take()
    assert {(r.stream, r.label) for r in records} == {("rs", "RS:x"), ("compute", "wait:RS:x")}
    ivs = intervals_from_records(records, t0)
    wait = next(r for r in records if r.stream == "compute")
    wait_us = ((wait.start_s - t0) * 1e6, (wait.end_s - t0) * 1e6)
    rs = next((iv.start_us, iv.end_us) for iv in ivs if iv.stream == "rs")
    compute = [(iv.start_us, iv.end_us) for iv in ivs if iv.stream == "compute"]
    assert intersect(compute, [wait_us]) == []
    exposed = total(intersect([rs], [wait_us])) / 1e3
    assert step_metrics(ivs)["exposed_comm_ms"] == pytest.approx(exposed)


def test_host_marks_name_phase_marks_and_submits_as_the_profiler_does():
    records = [OpRecord("compute", "begin:FWD:Block0", 1.0, 1.0, 7),
               OpRecord("ag", "wait:AG:Block0/0", 1.1, 1.1, 7),  # a wait: not a host cost
               OpRecord("ag", "submit:AG:Block1/0", 1.5, 1.5002, 7),
               OpRecord("compute", "end:FWD:Block0", 2.0, 2.0, 9)]
    assert host_marks(records, 1.0) == [[7, "hsdp.begin:FWD:Block0", 0.0, 0.0],
                                        [7, "hsdp:ag:AG:Block1/0", 500000.0, 200.0],
                                        [9, "hsdp.end:FWD:Block0", 1000000.0, 0.0]]
