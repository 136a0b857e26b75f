"""Step agreement: the collectives a step issued (``step_log.py``), compared across ranks
once per step.

Every collective hsdp issues is logged (kind, group id, stream) until the end of the step.
At the end of the step's last backward every rank all-reduces ONE small int64 tensor over
the world's CPU ``control`` group: the step's structure (microbatches, per-communicator
collective counts and a checksum of their sequence), whether this rank's step failed, and
which parameters received a gradient. Ranks that ran another structure, or a failed step
anywhere, are then known to every rank before the optimizer could use the gradients.

A rank that waits unusually long for the agreement leaves a note for its peers
(``note_board.py``; the watchdog of ``slow_watch.py``). The log it compares:
``step_log.py``.

After a failed step the logs are exchanged: each rank's log is a prefix of the same
sequence (the schedule is deterministic), so a rank that stopped early completes the
collectives the others already issued (``missing``), with dummy data, and every stream can
then be drained without waiting for a peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from hsdp.runtime.slow_watch import SLOW_S, WATCH
from hsdp.runtime.step_log import Desc, StepLog
from hsdp.topology.communicators import COMMUNICATORS
from hsdp.topology.liveness import gone_message

_FIELDS = ("step", "forwards", "microbatches", *(f"{c} collectives" for c in COMMUNICATORS),
           *(f"{c} sequence" for c in COMMUNICATORS))

T = TypeVar("T")


@dataclass
class Verdict:
    """What every rank learns from one agreement."""

    failed: bool  # some rank's step raised
    failed_rank: int | None  # the lowest rank where it raised first, if known
    mismatch: list[str]  # "field: min..max" for each field the ranks disagree on
    used: list[bool]  # per parameter: did any rank give it a gradient?

    @property
    def ok(self) -> bool:
        return not self.failed and not self.mismatch

    def message(self, step: int) -> str:
        if self.failed:
            where = "" if self.failed_rank is None else f" on rank {self.failed_rank}"
            why = f"its forward or backward raised{where} (see that rank's error)"
        else:
            why = (f"the ranks ran different step structures ({'; '.join(self.mismatch)}); "
                   f"every rank must run the same number of microbatches (is_last on the same "
                   f"one) and the same units in the same order")
        return (f"hsdp: step {step} was abandoned on every rank: {why}. Its gradients are "
                f"discarded; the next forward starts a new step.")


class Agreement:
    """One agreement's collective, issued (``async_op``) and not yet read: ``verdict()``
    waits for it (a dead or absent peer: an hsdp error after the timeout) and reads it."""

    def __init__(self, log: StepLog, failed: str, used: list[bool], group: dist.ProcessGroup,
                 timeout: timedelta) -> None:
        rank, self.world = dist.get_rank(), dist.get_world_size()
        f = log.fields()
        self.n, self.step, self.timeout = len(f), log.step, timeout
        vals = [int(bool(failed)), -(rank if failed == "origin" else self.world), *f,
                *(-x for x in f), *map(int, used)]
        self.t = torch.tensor(vals, dtype=torch.int64)
        self.work = self._run(lambda: dist.all_reduce(self.t, op=dist.ReduceOp.MAX,
                                                      group=group, async_op=True))

    def _run(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RuntimeError as exc:  # gloo: a peer did not join in time
            gone = gone_message()
            raise RuntimeError(
                f"hsdp: step {self.step}: the other ranks did not reach the end of this step "
                f"within the timeout ({self.timeout}): {gone + ' ' if gone else ''}a rank died "
                f"or is stuck, or the ranks "
                f"run different step structures (numbers of microbatches, units, "
                f"forward/backward passes). hsdp's communicators cannot be used any more: "
                f"restart the job.") from exc

    def verdict(self) -> Verdict:
        self._run(self.work.wait)
        v, n = self.t.tolist(), self.n
        hi, lo = v[2:2 + n], [-x for x in v[2 + n:2 + 2 * n]]
        mismatch = [f"{name}: {a}..{b}" for name, a, b in zip(_FIELDS, lo, hi) if a != b]
        failed_rank = (-v[1] if -v[1] < self.world else None) if v[0] else None
        return Verdict(bool(v[0]), failed_rank, mismatch, [bool(x) for x in v[2 + 2 * n:]])


def agree(log: StepLog, failed: str, used: list[bool], group: dist.ProcessGroup,
          timeout: timedelta, on_slow: Callable[[], None] | None = None) -> Verdict:
    """The one collective of a step: MAX-all-reduce of [failed, -failed rank, fields,
    -fields, used flags] (MAX of -x is -min). ``failed``: this rank's step raised, "origin"
    if it raised on its own, "peer" if only because another rank gave up (see ``read_note``).
    ``on_slow`` runs if it takes SLOW_S."""
    armed = WATCH.arm(SLOW_S, on_slow) if on_slow is not None else None
    try:
        return Agreement(log, failed, used, group, timeout).verdict()
    finally:
        if armed is not None:
            WATCH.disarm(armed)


def joined(what: str, key: str, run: Callable[[], T], timeout: timedelta) -> T:
    """``run()``, a blocking host collective that every rank joins; if it fails (gloo: a
    peer did not join within ``timeout``), raise an hsdp error naming the ranks that never
    reached it. A rank still waiting after SLOW_S marks ``key/<rank>`` in the store, so
    only slow calls touch the store."""
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()

    def mark() -> None:
        store.set(f"{key}/{rank}", "")

    start = time.monotonic()
    armed = WATCH.arm(SLOW_S, mark)
    try:
        return run()
    except RuntimeError as exc:
        WATCH.disarm(armed)
        mark()
        # Peers that entered when this rank did have marked by then (a dead peer can make
        # this rank fail before its own mark was due).
        time.sleep(max(0.0, start + 2 * SLOW_S - time.monotonic()))
        absent = [r for r in range(dist.get_world_size()) if not store.check([f"{key}/{r}"])]
        raise RuntimeError(
            f"hsdp: {what}: rank(s) {absent} did not join within the timeout ({timeout}): "
            f"they died, are stuck, or did not call it (every rank must). hsdp's "
            f"communicators cannot be used any more: restart the job.") from exc
    finally:
        WATCH.disarm(armed)


def missing(log: StepLog, group: dist.ProcessGroup) -> list[Desc]:
    """The collectives other ranks issued in this step and this rank did not (a second,
    rare collective: only after a failed step)."""
    mine = log.descs()
    if dist.get_backend(group) == "fake":
        return []
    logs: list[list[Desc] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(logs, mine, group=group)
    longest = max(logs, key=len)
    bad = [r for r, other in enumerate(logs) if longest[:len(other)] != other]
    if bad:
        raise RuntimeError(
            f"hsdp: step {log.step} cannot be recovered: ranks {bad} issued another sequence "
            f"of collectives than the others (another number of microbatches, is_last on "
            f"another microbatch, or data-dependent control flow around hsdp units). hsdp's "
            f"communicators cannot be used any more: restart the job.")
    return [tuple(d) for d in longest[len(mine):]]
