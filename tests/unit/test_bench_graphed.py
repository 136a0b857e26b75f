"""``bench step``'s ``-graph`` schedules off CUDA: a replay's trace read into intervals
(sleep kernels matched to the captured collectives by duration), the captured collectives
logged with their modelled durations, and the refusal without CUDA."""

import argparse

import pytest

from hsdp_tools.bench.emulate import DelayedCollectives
from hsdp_tools.bench.graphed import GraphedSteps, replay_intervals
from hsdp_tools.bench.step_config import add_arguments, resolve
from hsdp_tools.report.metrics import step_metrics
from hsdp_tools.sim.fabric import Fabric, Link

SLEEP = "void at::cuda::(anonymous namespace)::spin_kernel(long)"


def _kernel(name: str, ts: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, "device": 0}}


def test_replay_sleep_kernels_become_their_collectives():
    """A sleep kernel runs its modelled time or longer (the SM clock drops beside
    compute): the longest captured duration it reaches."""
    captured = [("ag", "AG", 100e-6), ("outer", "OUTER_AR", 400e-6), ("rs", "RS", 120e-6)]
    trace = {"traceEvents": [
        _kernel("gemm", 0, 1000, 7),
        _kernel(SLEEP, 50, 111, 20),  # the all-gather, 11 % long (nearest: the RS)
        _kernel(SLEEP, 900, 395, 21),  # the outer all-reduce, beside compute then alone
        _kernel(SLEEP, 1400, 250, 7),  # matches nothing captured: compute's own sleep
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
    ]}
    ivs = replay_intervals(trace, captured)
    assert [(iv.stream, iv.label) for iv in ivs] == [
        ("compute", "gemm"), ("ag", "AG"), ("outer", "OUTER_AR"), ("compute", SLEEP)]
    m = step_metrics(ivs)
    assert m["exposed_comm_ms"] == pytest.approx(0.295)  # the all-reduce after the gemm
    assert m["outer_tail_ms"] == pytest.approx(0.295)


def test_capture_logs_the_collectives_modelled_durations():
    fabric = Fabric(Link(100.0, 0.0), Link(10.0, 0.0))
    coll = DelayedCollectives(fabric, sleep=lambda s: None)
    graphed = GraphedSteps(coll)
    coll.before("all_reduce", "outer", 10**6, 2)  # not capturing: not kept
    graphed._logging = True
    coll.before("all_gather", "inner", 10**6, 4)
    coll.before("all_reduce", "outer", 10**6, 2)
    assert graphed.captured == [("ag", "AG", pytest.approx(7.5e-6)),
                                ("outer", "OUTER_AR", pytest.approx(1e-4))]


def test_graph_schedules_need_cuda():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--emulate", "--schedules", "overlap,overlap-graph"])
    with pytest.raises(SystemExit, match="overlap-graph capture CUDA graphs"):
        resolve(args, cuda=False, world=None)
    args = p.parse_args(["--emulate", "--schedules", "serial-graph", "--warmup", "2"])
    with pytest.raises(SystemExit, match="--warmup >= 3"):
        resolve(args, cuda=True, world=None)
