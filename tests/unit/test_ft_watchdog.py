"""The fault-tolerant outer all-reduce on NCCL: one watchdog per ``ElasticOuter`` aborts
torchft's group when a collective has not finished within the timeout (fake events, clock
and loop; then torchft's own event loop), and the all-reduce goes to the wrapper's current
communicator with torchft's options, not through the wrapper."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hsdp.ft.outer import CollectiveWatchdog, ElasticOuter
from hsdp.ft.transport import RecoveryTransport

TIMEOUT = 10.0


class FakeEvent:
    """A CUDA event whose completion the test decides."""

    made = 0

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.done = False
        self.records = 0

    def record(self) -> None:
        self.done = False
        self.records += 1

    def query(self) -> bool:
        return self.done


class FakeLoop:
    """An event loop that runs its timers only when the test moves its clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.wakeups = 0  # call_soon_threadsafe: a wake-up of the loop's thread

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        self.wakeups += 1
        fn(*args)

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self.timers.append((self.now + delay, fn))

    def advance(self, to: float) -> None:
        self.now = to
        due = sorted((t for t in self.timers if t[0] <= to), key=lambda t: t[0])
        self.timers = [t for t in self.timers if t[0] > to]
        for _, fn in due:
            fn()


def _watchdog() -> tuple[CollectiveWatchdog, FakeLoop, list[FakeEvent], list[float]]:
    """A watchdog on a fake loop; the events it made and the times it aborted at."""
    loop, events, aborts = FakeLoop(), [], []

    def new_event() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    wd = CollectiveWatchdog(TIMEOUT, lambda: aborts.append(loop.now), lambda: loop,
                            new_event, clock=lambda: loop.now)
    return wd, loop, events, aborts


def _track_at(wd: CollectiveWatchdog, loop: FakeLoop, when: float) -> None:
    loop.now = when
    wd.track()


def test_one_arming_for_many_collectives_and_reused_events():
    wd, loop, events, aborts = _watchdog()
    for i in range(100):
        _track_at(wd, loop, i * 0.01)
    assert loop.wakeups == 1 and [t for t, _ in loop.timers] == [TIMEOUT]
    for e in events:
        e.done = True
    loop.advance(TIMEOUT)
    assert aborts == [] and loop.timers == []  # all finished: disarmed
    _track_at(wd, loop, 20.0)
    assert loop.wakeups == 2 and [t for t, _ in loop.timers] == [20.0 + TIMEOUT]
    assert len(events) == 100 and sum(e.records for e in events) == 101  # one reused


def test_abort_when_the_oldest_pending_is_older_than_the_timeout():
    wd, loop, events, aborts = _watchdog()
    for when in (0.0, 1.0, 2.0):
        _track_at(wd, loop, when)
    events[0].done = True
    loop.advance(TIMEOUT)  # the oldest pending one (issued at 1) has 1 s left
    assert aborts == [] and [t for t, _ in loop.timers] == [1.0 + TIMEOUT]
    loop.advance(1.0 + TIMEOUT)
    assert aborts == [1.0 + TIMEOUT] and loop.timers == []
    events[1].done = events[2].done = True  # the abort ended them
    loop.advance(100.0)
    assert aborts == [1.0 + TIMEOUT]
    _track_at(wd, loop, 200.0)  # watched again, from a new timer
    assert loop.wakeups == 2 and [t for t, _ in loop.timers] == [200.0 + TIMEOUT]
    assert len(events) == 3  # the aborted ones are recorded again


def test_rearm_then_no_abort_when_the_collectives_finish():
    wd, loop, events, aborts = _watchdog()
    _track_at(wd, loop, 0.0)
    _track_at(wd, loop, 6.0)
    events[0].done = True
    loop.advance(TIMEOUT)
    assert [t for t, _ in loop.timers] == [6.0 + TIMEOUT]
    events[1].done = True
    loop.advance(6.0 + TIMEOUT)
    assert aborts == [] and loop.timers == [] and loop.wakeups == 1


def test_finished_events_behind_a_pending_one_keep_it_watched():
    wd, loop, events, aborts = _watchdog()
    _track_at(wd, loop, 0.0)
    _track_at(wd, loop, 5.0)
    events[1].done = True  # a later one done, the first one not: the stream still waits
    loop.advance(TIMEOUT)
    assert aborts == [TIMEOUT]


def test_torchfts_event_loop_runs_the_timer():
    futures = pytest.importorskip("torchft.futures")
    aborted = threading.Event()
    events: list[FakeEvent] = []

    def new_event() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    wd = CollectiveWatchdog(0.05, aborted.set, futures._TIMEOUT_MANAGER._maybe_start_event_loop,
                            new_event)
    wd.track()
    events[0].done = True
    assert not aborted.wait(0.3)  # finished in time
    wd.track()  # the event is reused, a new timer armed
    assert len(events) == 1 and aborted.wait(5.0)


class Work:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


class Parent:
    """The communicator torchft's wrapper holds: a sum over two equal replica groups."""

    def __init__(self) -> None:
        self.timeouts: list[timedelta] = []
        self.works: list[Work] = []
        self.aborted = False

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        assert opts.reduceOp == dist.ReduceOp.SUM
        self.timeouts.append(opts.timeout)
        tensors[0].mul_(2)
        self.works.append(Work())
        return self.works[-1]

    def abort(self) -> None:
        self.aborted = True


class Manager:
    def __init__(self, pg: Any) -> None:
        self._pg, self.error = pg, None
        self._checkpoint_transport = RecoveryTransport(pg)

    def errored(self) -> Exception | None:
        return self.error

    def is_participating(self) -> bool:
        return True

    def report_error(self, exc: Exception) -> None:
        self.error = exc


def test_nccl_all_reduce_bypasses_the_wrapper_and_a_late_one_aborts_it(monkeypatch):
    tft = pytest.importorskip("torchft")
    from torchft.process_group import ProcessGroupWrapper

    class NCCL(tft.ProcessGroupNCCL):
        def __init__(self, parent: Parent) -> None:  # torchft's asks NCCL for its version
            ProcessGroupWrapper.__init__(self, timedelta(seconds=0.1), pg=parent)
            self._use_abort, self._errored = True, None

        def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
            raise AssertionError("the NCCL path must not go through torchft's wrapper")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    parent = Parent()
    wrapper = NCCL(parent)
    manager = Manager(wrapper)
    outer = ElasticOuter(manager)
    t = torch.ones(4)
    made = FakeEvent.made
    outer.all_reduce(t, avg=True, n=2)
    assert torch.equal(t, torch.ones(4)) and manager.error is None
    assert parent.timeouts == [dist.AllreduceOptions().timeout]  # NCCL's default
    assert [w.waits for w in parent.works] == [1] and FakeEvent.made == made + 1
    # the event never completes: the wrapper is aborted after its timeout, as torchft does
    for _ in range(100):
        if parent.aborted:
            break
        threading.Event().wait(0.05)
    assert parent.aborted and wrapper._errored is not None
    outer.all_reduce(t, avg=True, n=2)  # no communicator until the next quorum
    assert isinstance(manager.error, AssertionError)
    outer.all_reduce(t, avg=True, n=2)  # the step has errored: a no-op
    assert len(parent.works) == 1 and torch.equal(t, torch.ones(4))
