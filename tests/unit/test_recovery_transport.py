"""hsdp's recovery transport, in one process: live ranks send over an in-process stand-in
for torchft's process group (point-to-point queues), recovering ranks receive on threads
and meet in a shared store. What arrives equals what was sent; a payload carrying code is
refused without running it (weights_only); a corrupted one is refused by its digest; a
recovery that fails on one rank fails on every rank, and a retry does not read the last
attempt's outcomes; progress a failed recovery lost is refused unless allowed."""

from __future__ import annotations

import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hsdp.ft.errors import FaultToleranceError
from hsdp.ft.outer import FaultTolerance, make_manager
from hsdp.ft.transport import RecoveryTransport

T = timedelta(seconds=5)


class Wire:
    """Messages between in-process replica ranks, one queue per (src, dst, tag);
    ``corrupt`` flips a byte of every message with that tag."""

    def __init__(self, corrupt: int | None = None) -> None:
        self._queues: dict[tuple[int, int, int], queue.Queue] = {}
        self._lock = threading.Lock()
        self.corrupt = corrupt

    def queue(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((src, dst, tag), queue.Queue())


class Done:
    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class Received:
    def __init__(self, q: queue.Queue, into: torch.Tensor) -> None:
        self.q, self.into = q, into

    def wait(self, timeout: timedelta) -> bool:
        try:
            self.into.copy_(self.q.get(timeout=timeout.total_seconds()))
        except queue.Empty:
            raise RuntimeError("recv timed out") from None
        return True


class End:
    """One replica rank's view of the wire: ``send`` / ``recv`` as torchft's group has."""

    def __init__(self, wire: Wire, me: int) -> None:
        self.wire, self.me = wire, me

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Done:
        t = tensors[0].clone()
        if tag == self.wire.corrupt:
            t.view(torch.uint8)[-1] ^= 1
        self.wire.queue(self.me, dst, tag).put(t)
        return Done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Received:
        return Received(self.wire.queue(src, self.me, tag), tensors[0])


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    flat = torch.randn(40, generator=g)
    return {"user": {"hsdp": {"params": {"w": flat[:30].view(5, 6), "b": flat[30:]},
                              "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99),
                                                "foreach": None}],
                              "lr_scheduler": {"last_epoch": step}}},
            "torchft": {"step": step, "batches_committed": 2 * step}}


def _recover(wire: Wire, world: int, step: int = 5, **kw: Any) -> list[Any]:
    """Each of ``world`` recovering ranks receives ``step`` from the live rank of the same
    index (replica rank 0 of ``wire``; the recovering group is replica rank 1), on its own
    thread: what each returned, or the error it raised."""
    store, results = dist.HashStore(), [None] * world

    def run(r: int) -> None:
        transport = RecoveryTransport(End(wire, 1), **kw)
        transport.bind(lambda: 7, store=store, rank=r, world=world)
        try:
            results[r] = transport.recv_checkpoint(0, "hsdp", step, T / 10)
        except Exception as exc:
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _send(wire: Wire, state: Any, step: int = 5) -> None:
    RecoveryTransport(End(wire, 0)).send_checkpoint([1], step, state, T)


def test_what_arrives_equals_what_was_sent():
    wire = Wire()
    _send(wire, _state(5))
    (got,) = _recover(wire, 1)
    want = _state(5)
    assert got["torchft"] == want["torchft"]
    mine, theirs = got["user"]["hsdp"], want["user"]["hsdp"]
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["lr_scheduler"] == theirs["lr_scheduler"]
    for n, t in theirs["params"].items():
        assert torch.equal(mine["params"][n], t)


class Payload:
    """What an attacker would send: unpickling it runs ``os.system``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.path}",)


def test_a_payload_carrying_code_is_refused_without_running_it(tmp_path):
    ran = tmp_path / "ran"
    wire = Wire()
    _send(wire, {"user": {"hsdp": Payload(str(ran))}, "torchft": {"step": 5}})
    (got,) = _recover(wire, 1)
    assert isinstance(got, FaultToleranceError), got
    assert "cannot recover" in str(got) and "add_safe_globals" in str(got), got
    assert not ran.exists()


def test_a_corrupted_transfer_is_refused_by_its_digest():
    wire = Wire(corrupt=2)  # the payload's first (only) chunk
    _send(wire, _state(5))
    (got,) = _recover(wire, 1)
    assert isinstance(got, FaultToleranceError) and "SHA-256" in str(got), got


def test_a_recovery_failing_on_one_rank_fails_on_every_rank():
    """Live rank 0 sends nothing (it died), live rank 1 everything: recovering rank 1
    holds a good state, and still raises, as rank 0 does: nothing is applied anywhere."""
    wire = Wire()
    store = dist.HashStore()
    results: list[Any] = [None, None]
    sender = RecoveryTransport(End(wire, 0))

    def run(r: int) -> None:
        # rank r of the recovering group listens on its own wire to rank r of the live one
        transport = RecoveryTransport(End(wires[r], 1))
        transport.bind(lambda: 7, store=store, rank=r, world=2)
        try:
            results[r] = transport.recv_checkpoint(0, "hsdp", 5, T / 10)
        except Exception as exc:
            results[r] = exc

    wires = [Wire(), wire]
    sender.send_checkpoint([1], 5, _state(5), T)  # to rank 1 only
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(2):
        assert isinstance(results[r], FaultToleranceError), results[r]
        assert "failed on 1 of this group's 2 ranks (rank 0: RuntimeError: recv timed out" \
            in str(results[r])


def test_a_retry_meets_under_new_keys():
    """A retry in the same quorum (torchft counted the failed commit in between) does not
    read the last attempt's outcomes: rank 1, done first, waits for rank 0's new one."""
    store, failures = dist.HashStore(), [0]
    results: dict[int, Any] = {}

    def run(r: int, wire: Wire) -> None:
        transport = RecoveryTransport(End(wire, 1))
        transport.bind(lambda: f"3/{failures[0]}", store=store, rank=r, world=2)
        try:
            results[r] = transport.recv_checkpoint(0, "hsdp", 5, T / 10)
        except Exception as exc:
            results[r] = exc

    # attempt 1: rank 0's sender is gone, rank 1's sends everything: both fail
    dead, live = Wire(), Wire()
    _send(live, _state(5))
    threads = [threading.Thread(target=run, args=(r, w)) for r, w in ((0, dead), (1, live))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(results[r], FaultToleranceError) for r in range(2))
    failures[0] += 1  # the group's commit vote failed on every rank
    # attempt 2: both senders send; rank 1 receives first and must wait for rank 0
    wires = [Wire(), Wire()]
    for w in wires:
        _send(w, _state(5))
    results.clear()
    early = threading.Thread(target=run, args=(1, wires[1]))
    early.start()
    early.join(0.5)
    assert early.is_alive() and not results, results  # not decided on a stale outcome
    late = threading.Thread(target=run, args=(0, wires[0]))
    late.start()
    for t in (early, late):
        t.join()
    for r in range(2):
        assert isinstance(results[r], dict) and results[r]["torchft"]["step"] == 5, results[r]


def _failed_recovery(allowed: bool) -> RecoveryTransport:
    """A transport whose recovery of step 5 failed: nothing came (the live group is gone)."""
    transport = RecoveryTransport(End(Wire(), 1), allow_lost_progress=allowed)
    transport.bind(lambda: 7, store=dist.HashStore(), rank=0, world=1)
    transport.expect(5)  # the quorum asked for step 5
    with pytest.raises(FaultToleranceError, match="recovering step 5"):
        transport.recv_checkpoint(0, "hsdp", 5, T / 10)
    return transport


def test_progress_a_failed_recovery_lost_is_refused_unless_allowed(caplog):
    refusing = _failed_recovery(allowed=False)
    refusing.check_progress(5)  # recovered since (a later attempt): nothing lost
    with pytest.raises(FaultToleranceError, match="was to recover step 5 .* drops 5 step"):
        refusing.check_progress(0)
    allowing = _failed_recovery(allowed=True)
    allowing.check_progress(0)
    assert "drops 5 step(s) of progress (allow_lost_progress=True)" in caplog.text
    allowing.check_progress(0)  # said once; training goes on from step 0
    with pytest.raises(TypeError, match="allow_lost_progress must be a bool"):
        FaultTolerance(allow_lost_progress="yes")


def test_a_manager_recovering_through_another_transport_is_refused():
    tft = pytest.importorskip("torchft")
    manager = tft.Manager.__new__(tft.Manager)  # no lighthouse needed for the check
    manager._checkpoint_transport = object()
    with pytest.raises(FaultToleranceError, match="recovers through object; make it with "
                                                  "checkpoint_transport=hsdp.RecoveryTransport"):
        make_manager(manager, "cpu")


def test_a_recovery_failing_before_the_transfer_fails_the_others_at_once():
    """Recovering rank 0's torchft fails before the transfer (asking the dead sender for
    its metadata) and reports the error; rank 1 received everything and waits for rank
    0's outcome: it fails with rank 0's error at once, not after twice the timeout (by
    which time rank 0's commit vote had timed out waiting for it, ending the group)."""
    tft = pytest.importorskip("torchft")
    store, wire = dist.HashStore(), Wire()
    _send(wire, _state(5))
    early = RecoveryTransport(End(Wire(), 1))
    manager = tft.Manager.__new__(tft.Manager)  # the wiring of make_manager's report_error
    manager._checkpoint_transport, manager._client = early, object()
    manager._quorum_id, manager._commit_failures, manager._errored = 3, 0, None
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        make_manager(manager, "cpu")
    finally:
        dist.destroy_process_group()
    early.bind(lambda: f"{manager._quorum_id}/{manager._commit_failures}", store=store,
               rank=0, world=2)
    late = RecoveryTransport(End(wire, 1))
    late.bind(lambda: "3/0", store=store, rank=1, world=2)
    early.expect(5)
    manager.report_error(RuntimeError("transport error"))
    assert manager.errored() is not None  # torchft's own report still made
    start = time.monotonic()
    with pytest.raises(FaultToleranceError, match=r"failed on 1 of this group's 2 ranks \(rank "
                                                  r"0: RuntimeError: transport error \(before"):
        late.recv_checkpoint(0, "hsdp", 5, T)
    assert time.monotonic() - start < T.total_seconds()
    # rank 0's torchft does not call recv_checkpoint after the failure; if it did, it
    # would post nothing new and fail with the group
    with pytest.raises(FaultToleranceError, match="rank 0: RuntimeError: transport error"):
        early.recv_checkpoint(0, "hsdp", 5, T / 10)
