"""CPU stream backend: order, dependencies, failures, tracing."""

import threading
import time

import pytest
import torch

from hsdp.ft.errors import FaultToleranceError
from hsdp.streams.cpu_backend import StreamFailure
from hsdp.streams.stream_set import Streams


def test_fifo_order_and_cross_stream_dependency():
    s = Streams.create(torch.device("cpu"))
    log: list[str] = []
    gate = threading.Event()
    a = s.ag.submit(lambda: (gate.wait(), log.append("ag1")), label="AG1")
    b = s.rs.submit(lambda: log.append("rs1"), after=[a], label="RS1")
    c = s.ag.submit(lambda: log.append("ag2"), label="AG2")
    time.sleep(0.05)
    assert log == [] and not b.query()
    gate.set()
    s.compute.wait(b)
    s.compute.wait(c)
    assert log.index("ag1") < log.index("rs1") and log.index("ag1") < log.index("ag2")


def test_failure_surfaces_to_the_waiter_and_poisons_every_stream_until_cleared():
    s = Streams.create(torch.device("cpu"))
    bad = s.outer.submit(lambda: 1 / 0, label="OUTER_AR:x")
    with pytest.raises(StreamFailure, match="OUTER_AR:x.*ZeroDivisionError"):
        s.compute.wait(bad)
    ran: list[str] = []
    later = s.ag.submit(lambda: ran.append("ag"), label="AG:y")  # another stream
    with pytest.raises(StreamFailure, match="AG:y.*ZeroDivisionError"):
        s.compute.wait(later)
    assert ran == []
    assert s.quiesce(5.0)  # teardown: no error
    s.failed.clear()
    ok = s.ag.submit(lambda: ran.append("ag"))
    s.compute.wait(ok)
    assert ran == ["ag"]


def test_a_fault_tolerance_verdict_surfaces_unchanged():
    """hsdp's own FaultToleranceError (raised on the outer stream, where the quorum is
    first known) reaches the waiter as it is, not wrapped as a stream failure."""
    s = Streams.create(torch.device("cpu"))
    verdict = FaultToleranceError("hsdp: progress lost")

    def refuse() -> None:
        raise verdict

    bad = s.outer.submit(refuse, label="OUTER_AR:x")
    with pytest.raises(FaultToleranceError) as raised:
        s.compute.wait(bad)
    assert raised.value is verdict
    assert s.quiesce(5.0)
    s.failed.clear()


def test_tracer_records_ops_and_blocking_compute_waits():
    s = Streams.create(torch.device("cpu"))
    s.tracer.enabled = True
    ev = s.rs.submit(lambda: time.sleep(0.02), label="RS:u")
    s.compute.wait(ev)
    recs = s.tracer.take()
    names = {(r.stream, r.label) for r in recs}
    assert ("rs", "RS:u") in names and ("compute", "wait:RS:u") in names
    assert all(r.end_s >= r.start_s for r in recs)
