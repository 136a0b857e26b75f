"""How the ranks of a save or load meet, and the error they all raise when that fails.

Each meeting point is a gloo collective on a host group (bounded by its timeout). Before
it, a rank leaves a key in the default store; when the collective fails (a raw gloo
error: a peer died or is stalled), the keys say which ranks never arrived, and every rank
raises a ``CheckpointError`` naming them, the phase and the save or load.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

from hsdp.topology.communicators import default_timeout

T = TypeVar("T")
# Process-wide: saves and loads are collectives, numbered alike on every rank.
_IDS = itertools.count()


class CheckpointError(RuntimeError):
    """``hsdp.save`` / ``hsdp.load`` failed (a bad file, a failed write, a stalled peer).
    An ``Exception``, unlike DCP's ``CheckpointException``; raised on every rank."""


class CheckpointBusyError(CheckpointError):
    """``hsdp.save``: another job is saving to the same path (``save_lock.py``); this save
    wrote nothing. Raised on every rank."""


class Meeting:
    """The meeting points of one ``what`` (``"hsdp.save"`` / ``"hsdp.load"``) of ``path``."""

    def __init__(self, what: str, path: str) -> None:
        self.what, self.path, self.id = what, path, next(_IDS)
        self.rank = dist.get_rank()
        self._phases: list[str] = []  # in the order this rank met them
        fake = dist.get_backend() == "fake"  # torch's fake world: nothing to wait for
        self._store = None if fake else dist.distributed_c10d._get_default_store()

    def _key(self, phase: str, rank: int) -> str:
        return f"hsdp/ckpt/{self.id}/{phase}/{rank}"

    def arrive(self, phase: str) -> None:
        """Note that this rank reached ``phase`` (a background writer calls it too)."""
        if self._store is not None:
            self._store.set(self._key(phase, self.rank), "1")

    @contextmanager
    def at(self, phase: str, arrive: bool = True) -> Iterator[None]:
        """Run the collectives of ``phase``; a raw communication error becomes a
        ``CheckpointError`` naming the ranks that did not reach it. ``arrive=False``:
        ranks arrive from elsewhere (the writer, once its data is written)."""
        self._phases.append(phase)
        try:
            if arrive:
                self.arrive(phase)
            yield
        except RuntimeError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(self.stalled(phase, e)) from e

    def stalled(self, phase: str, error: BaseException) -> str:
        """The error message: the first phase that some rank never reached."""
        who = "every rank reached it, then communication failed"
        try:
            for seen in self._phases if self._store is not None else ():
                missing = [r for r in range(dist.get_world_size())
                           if not self._store.check([self._key(seen, r)])]
                if missing:
                    phase, who = seen, f"rank(s) {missing} never reached it"
                    break
        except dist.DistError:  # the store is served by rank 0's process
            who = "rank 0 no longer answers (it serves the default store): it died"
        return (f"{self.what} of {self.path} (#{self.id}) failed on rank {self.rank} at "
                f"{phase}: {who} (timeout {default_timeout().total_seconds():g} s); a peer "
                f"rank died or is stalled. ({error})")

    def first_failure(self, group: dist.ProcessGroup, phase: str,
                      error: BaseException | None) -> str | None:
        """Every rank's ``error`` exchanged: the first one ("rank R: ..."), or None."""
        every: list[str | None] = [None] * dist.get_world_size()
        with self.at(phase):
            dist.all_gather_object(every, None if error is None else f"rank {self.rank}: "
                                   f"{error}", group=group)
        return next((e for e in every if e is not None), None)

    def verdict(self, group: dist.ProcessGroup, phase: str, fn: Callable[[], T]) -> T:
        """``fn()`` on every rank; if it raised on any, every rank raises the exception of
        the first rank that did (that rank its own), so no rank goes on alone."""
        result: Any = None
        error: Exception | None = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
        every: list[Any] = [None] * dist.get_world_size(group)
        with self.at(phase):
            dist.all_gather_object(every, _portable(error), group=group)
        first = next((i for i, e in enumerate(every) if e is not None), None)
        if first is None:
            return result
        if error is not None and first == dist.get_rank(group):
            raise error
        raise every[first]

    def agree(self, group: dist.ProcessGroup, phase: str, fn: Callable[[], T]) -> T:
        """``fn()`` on rank 0, its result (or its exception, raised) on every rank."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = (fn(), None)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                box[0] = (None, e)
        with self.at(phase):
            dist.broadcast_object_list(box, src=0, group=group)
        result, error = box[0]
        if error is not None:
            raise error
        return result


def _portable(error: Exception | None) -> Exception | None:
    """``error`` as another rank can unpickle it (else a ``CheckpointError`` saying it)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return CheckpointError(f"{type(error).__name__}: {error}")
