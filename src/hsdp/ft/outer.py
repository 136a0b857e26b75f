"""The outer axis as torchft replica groups (``init_mesh(..., fault_tolerance=...)``).

Each outer index is a replica group: its own torch world of ``inner`` ranks that holds a
whole model. The outer gradient all-reduce runs over torchft's managed process group, whose
members are the replica groups in the current quorum (rank ``i`` of every live group
together), and averages over the replicas that take part in the step (the divisor follows
the quorum, not the configured outer size). A replica that fails mid-step makes the
collective fail: torchft records the error and ``Manager.should_commit()`` is False on
every survivor, which then discard the step. torchft is an optional dependency
(``pip install 'hsdp[ft]'``); this module imports it only when fault tolerance is asked
for. It imports nothing of hsdp outside ``ft/`` (``sharding/comm.py`` dispatches to
``ElasticOuter``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hsdp.ft.errors import FaultToleranceError
from hsdp.ft.transport import RecoveryTransport

log = logging.getLogger(__name__)

LIGHTHOUSE_COMMAND = ("torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 "
                      "--join_timeout_ms 10000")


@dataclass(frozen=True)
class FaultTolerance:
    """How hsdp makes each rank's torchft ``Manager``. ``lighthouse``: the address of
    ``torchft_lighthouse`` (default: ``$TORCHFT_LIGHTHOUSE``); ``replica_id``: this replica
    group's id, the same on its ranks (default: ``$REPLICA_GROUP_ID``); ``min_replicas``:
    a step commits only with at least this many replica groups taking part. ``timeout``
    bounds the outer all-reduce, ``should_commit`` and the recovery transfer;
    ``quorum_timeout`` the wait for a quorum; ``connect_timeout`` reaching the lighthouse.
    ``allow_lost_progress``: when every live group was lost while sending its state to this
    one, train on from this group's own (older) step instead of raising."""

    lighthouse: str | None = None
    replica_id: str | None = None
    min_replicas: int = 1
    timeout: timedelta = timedelta(seconds=60)
    quorum_timeout: timedelta = timedelta(seconds=60)
    connect_timeout: timedelta = timedelta(seconds=10)
    allow_lost_progress: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"FaultTolerance.min_replicas must be an int >= 1, "
                             f"got {self.min_replicas!r}")
        if not isinstance(self.allow_lost_progress, bool):
            raise TypeError(f"FaultTolerance.allow_lost_progress must be a bool, "
                            f"got {self.allow_lost_progress!r}")


def torchft() -> Any:
    """The torchft module, or a clear error naming the extra to install."""
    try:
        import torchft as ft
    except ImportError as exc:
        raise FaultToleranceError(
            f"hsdp: fault tolerance needs torchft ({exc}); install it with "
            f"pip install 'hsdp[ft]'") from exc
    return ft


class CollectiveWatchdog:
    """Aborts a group when a collective issued on it has not finished within ``timeout_s``,
    with one timer for all of them on an event loop's thread (torchft's).

    ``track()`` after each collective records an event on the current stream, queues it
    with its issue time and arms the timer only when none is armed. When the timer fires
    it drops the finished events from the front (one stream: they finish in order),
    calls ``abort`` if the oldest pending one is older than the timeout, else re-arms
    for that one's remaining time, else disarms.
    **WHY one timer**: a timer per collective (torchft's) wakes its thread, which takes the GIL.
    **WHY an event per collective**: recording one is asynchronous (no host wait, no wake-up).
    **WHY finished events are reused**: destroying one may block; the loop thread must not."""

    def __init__(self, timeout_s: float, abort: Callable[[], None],
                 loop: Callable[[], Any], new_event: Callable[[], Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._abort, self._loop, self._new_event, self._clock = abort, loop, new_event, clock
        self._lock = threading.Lock()
        self._pending: deque[tuple[Any, float]] = deque()  # (event, issue time)
        self._free: list[Any] = []  # finished events, recorded again by track()
        self._armed = False

    def track(self) -> None:
        """Watch the collective just issued on the current stream."""
        issued = self._clock()
        with self._lock:
            event = self._free.pop() if self._free else None
        if event is None:
            event = self._new_event()
        event.record()  # outside the lock: a launch may wait for room in the queue
        with self._lock:
            self._pending.append((event, issued))
            if self._armed:
                return
            self._armed = True
        loop = self._loop()
        loop.call_soon_threadsafe(loop.call_later, self.timeout_s, self._fire)

    def _fire(self) -> None:
        """The timer, on the loop's thread: drop the finished, then abort, re-arm or disarm."""
        with self._lock:
            while self._pending and self._pending[0][0].query():
                self._free.append(self._pending.popleft()[0])
            late = bool(self._pending)
            if late:
                remaining = self._pending[0][1] + self.timeout_s - self._clock()
                if remaining > 0:
                    self._loop().call_later(remaining, self._fire)
                    return
                # the abort ends every pending collective: their events can be recorded again
                self._free.extend(event for event, _ in self._pending)
                self._pending.clear()
            self._armed = False
        if late:
            log.error("hsdp: an outer all-reduce did not finish within %g s: aborting "
                      "torchft's process group", self.timeout_s)
            self._abort()


class ElasticOuter:
    """hsdp's outer communicator as a torchft managed group: an all-reduce (sum or mean
    over the participating replica groups) and the number of them.

    The all-reduce keeps ``Manager.allreduce``'s semantics (nothing once the step has
    errored; zeros from a group that is healing; a SUM divided by the participants; an
    error recorded for ``should_commit`` instead of raised) but issues it on the
    Manager's reconfigurable process group itself: **WHY**: ``Manager.allreduce`` wraps
    every call in a chain of futures with a timeout each, registered on torchft's event
    loop thread, which costs the issuing thread several times the collective's own host
    time, once per unit and step.

    gloo: through torchft's wrapper, which adds nothing per collective there (no hooks;
    gloo's own ``timeout`` bounds the collective). NCCL with torchft's abort mode: on the
    wrapper's current communicator (``parent``, rebuilt by torchft at each new quorum),
    watched by one ``CollectiveWatchdog`` that aborts the wrapper as torchft's timers do.
    **WHY not the wrapper**: 3 loop wake-ups per collective (H200: backward 57 -> 74 ms host).
    **WHY unset timeout in the options**: NCCL's 10-min default (as torchft's) must not kill first.
    **WHY an abort is enough**: it sets the wrapper's error: ``should_commit()`` is then False.
    **WHY no timer around the issue**: torchft's NCCL is non-blocking; torch bounds its waits."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.recovery: RecoveryTransport = manager._checkpoint_transport
        # torchft 0.2.0 keeps its reconfigurable group here (the one passed as pg=...)
        self._pg = manager._pg
        self._watchdog: CollectiveWatchdog | None = None
        self._left = False  # shut down after an unrecoverable recovery
        tft = torchft()
        if isinstance(self._pg, tft.ProcessGroupNCCL) and self._pg._use_abort:
            from torchft.futures import _TIMEOUT_MANAGER
            self._watchdog = CollectiveWatchdog(
                self._pg._timeout.total_seconds(), self._pg.abort,
                _TIMEOUT_MANAGER._maybe_start_event_loop, torch.cuda.Event)

    def size(self) -> int:
        """The replica groups that take part in this step (waits for the quorum). Raises
        ``FaultToleranceError`` if this group would train at an older step than a failed
        recovery was to bring (``RecoveryTransport.check_progress``), or if no recovery
        can succeed (``RecoveryTransport.unrecoverable``): this group then leaves torchft
        (its Manager shut down), so that the live groups' quorums go on without it."""
        n = self.manager.num_participants()
        if self.recovery.unrecoverable is not None:
            if not self._left:
                self._left = True
                self.manager.shutdown(wait=False)
            raise FaultToleranceError(self.recovery.unrecoverable)
        if self.manager.is_participating():
            self.recovery.check_progress(self.manager.current_step())
        return n

    def all_reduce(self, t: torch.Tensor, avg: bool, n: int) -> None:
        """``t`` = the sum (``avg``: the mean) over the ``n`` = ``size()`` participating
        replica groups (the caller has waited for the quorum). A group that is recovering
        contributes zeros; an error is recorded by torchft (the step does not commit)
        instead of raised."""
        manager = self.manager
        if manager.errored() is not None:
            return  # the step will not commit: the remaining reductions are no-ops
        if not manager.is_participating():
            t.zero_()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        try:
            if self._watchdog is None:
                self._pg.allreduce([t], opts).wait()
            else:  # parent: an AssertionError once aborted, until the next quorum
                self._pg.parent.allreduce([t], opts).wait()
                self._watchdog.track()
        except Exception as exc:  # torchft's contract: record, don't raise
            manager.report_error(exc)
            return
        if avg and n > 1:
            t.div_(n)


def _where(ft: FaultTolerance) -> tuple[str, str, str, int]:
    """The lighthouse address, the replica id and the replica group's store (host, port):
    from the settings, else the environment; a clear error naming what is missing."""
    lighthouse = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    replica_id = ft.replica_id or os.environ.get("REPLICA_GROUP_ID")
    missing = [what for what, v in (("lighthouse (FaultTolerance(lighthouse=...) or "
                                     "$TORCHFT_LIGHTHOUSE)", lighthouse),
                                    ("replica_id (FaultTolerance(replica_id=...) or "
                                     "$REPLICA_GROUP_ID)", replica_id)) if not v]
    if missing:
        raise FaultToleranceError(f"init_mesh(fault_tolerance=...): no {' and no '.join(missing)}")
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host is None or port is None:
        raise FaultToleranceError("init_mesh(fault_tolerance=...): the replica group's store "
                                  "address is read from MASTER_ADDR / MASTER_PORT (torchrun); "
                                  "launch each replica group with torchrun")
    return lighthouse, str(replica_id), host, int(port)


def make_manager(ft: FaultTolerance | Any, device_type: str, sync_quorum: bool = False) -> Any:
    """This rank's torchft ``Manager``: ``ft`` itself if it is one (made with
    ``checkpoint_transport=hsdp.RecoveryTransport(...)``), else one made from the settings
    for this replica group (the current torch world), recovering through a
    ``RecoveryTransport`` over its own process group. Rank 0 of the group reaches the
    lighthouse first; if it cannot, every rank raises the same error.

    ``init_sync=False``: hsdp's ranks build the same initial model (same seed, see
    ``materialize.py``), so the replica groups start equal. torchft's step-0 sync would
    make them recover from each other in the first step, whose gradient would then be
    one group's divided by the number of groups. ``sync_quorum`` (DiLoCo, which asks
    for a quorum at each sync and waits for it): ``use_async_quorum=False``."""
    tft = torchft()
    if isinstance(ft, tft.Manager):
        return _bound(ft)
    if not isinstance(ft, FaultTolerance):
        raise TypeError(f"init_mesh: fault_tolerance must be a hsdp.FaultTolerance or a "
                        f"torchft.Manager, got {type(ft).__name__}")
    lighthouse, replica_id, host, port = _where(ft)
    pg_class = tft.ProcessGroupGloo if device_type == "cpu" else tft.ProcessGroupNCCL
    rank, world = dist.get_rank(), dist.get_world_size()

    def build() -> Any:
        pg = pg_class(timeout=ft.timeout)
        return _bound(tft.Manager(
            pg=pg, load_state_dict=None, state_dict=None,
            min_replica_size=ft.min_replicas, timeout=ft.timeout,
            quorum_timeout=ft.quorum_timeout, connect_timeout=ft.connect_timeout,
            rank=rank, world_size=world, store_addr=host, store_port=port,
            lighthouse_addr=lighthouse, replica_id=replica_id, init_sync=False,
            use_async_quorum=not sync_quorum,
            checkpoint_transport=RecoveryTransport(pg, device_type, ft.allow_lost_progress)))

    # Rank 0 hosts the group's ManagerServer, which connects to the lighthouse; the
    # others would wait for its address until the store's timeout: share the outcome.
    key = f"hsdp/ft/manager/{replica_id}"
    default_store = dist.distributed_c10d._get_default_store()
    manager = None
    if rank == 0:
        try:
            manager = build()
            failure = ""
        except RuntimeError as exc:
            failure = str(exc).splitlines()[0]
        default_store.set(key, failure)
    else:
        default_store.wait([key], ft.connect_timeout * 2 + timedelta(seconds=30))
        failure = default_store.get(key).decode()
    if failure:
        raise FaultToleranceError(
            f"hsdp: replica group {replica_id} cannot reach the torchft lighthouse at "
            f"{lighthouse} within {ft.connect_timeout.total_seconds():g} s ({failure}). Start "
            f"it first ({LIGHTHOUSE_COMMAND}) and pass its address as "
            f"FaultTolerance(lighthouse=...) or $TORCHFT_LIGHTHOUSE")
    return manager if manager is not None else build()


def _bound(manager: Any) -> Any:
    """``manager``, its ``RecoveryTransport`` bound to this replica group's store; any
    other transport is refused (torchft's default serves the state over unauthenticated
    HTTP and unpickles what it receives)."""
    transport = manager._checkpoint_transport  # torchft 0.2.0's attribute
    if not isinstance(transport, RecoveryTransport):
        raise FaultToleranceError(
            f"init_mesh(fault_tolerance=manager): the Manager recovers through "
            f"{type(transport).__name__}; make it with checkpoint_transport="
            f"hsdp.RecoveryTransport(pg, device_type) over its own pg "
            f"(docs/guide/fault_tolerance.md, 'What recovery exposes')")
    # an attempt (with the step it recovers): torchft's quorum (the same for the group's
    # ranks) and the failed commits since the last one (a failed recovery fails the
    # group's commit vote: +1 on every rank), so that a retry in the same quorum meets
    # under new keys (torchft 0.2.0's attribute names)
    transport.bind(lambda: f"{manager._quorum_id}/{manager._commit_failures}")
    manager._client = _QuorumWatch(manager._client, transport)
    report = manager.report_error

    def report_error(exc: Exception) -> None:
        # WHY: a recovery that failed on this rank before the transfer is told to the
        # group's ranks waiting in it (RecoveryTransport.fail_early)
        transport.fail_early(exc)
        report(exc)

    manager.report_error = report_error
    return manager


class _QuorumWatch:
    """torchft's client of the group's ManagerServer, telling ``transport`` which step
    each quorum asks this group to recover, as soon as the quorum is known. **WHY here**:
    torchft's recovery can fail before the transport is called (fetching the sender's
    address from a dead group), and the group must still know what it was to receive."""

    def __init__(self, client: Any, transport: RecoveryTransport) -> None:
        self._client, self._transport = client, transport

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        if quorum.heal:
            self._transport.expect(quorum.max_step)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
