"""Which ranks are gone: a store-based liveness probe, for error messages.

A collective that fails because a peer died names a socket, not a rank, and ranks that
only waited on a survivor name nothing at all. So each process of a world that hsdp
meshes runs one responder thread on its own client of the default store, blocked in the
store's server-side ``wait`` for its key of the next probe (no traffic and no log lines
while nothing fails). After a communication error, ``gone_message`` posts a probe (one key
per rank) and collects the answers for ``PROBE_S``: ranks that do not answer died or hang
with the interpreter held. A default store that no longer answers means its host died
(rank 0 under torchrun's defaults). ``stop`` wakes this rank's responder through its own
key, before the world's store goes: at ``destroy_process_group`` (``streams/teardown.py``)
and at the interpreter's exit (an ``atexit`` hook). **WHY at exit too**: a process that
ends without ``destroy_process_group`` would finalize the interpreter with the responder
still in the store's C++ wait; when rank 0's store then closes, the wait raises into a
thread that may no longer take the GIL, and the process aborts (SIGABRT, a failed job
under torchrun) instead of exiting 0.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from datetime import timedelta

import torch.distributed as dist

PROBE_S = 5.0  # how long a probe collects answers (a loaded host is slow to answer)
_WAIT = timedelta(days=365)  # a responder waits until probed or stopped
_KEY = "hsdp/liveness"

# Process-wide: one liveness responder per process, and what it learned of gone ranks.
_responder: _Responder | None = None
_exit_hook = False  # whether ``stop`` runs at the interpreter's exit
_found: dict[tuple[int, int], str] = {}  # (rank, world) -> the message once a rank was gone


class _Responder(threading.Thread):
    """Answers probe ``n`` (key ``{_KEY}/probe/n/<rank>``) with ``{_KEY}/n/<rank>``, for
    n = 1, 2, ..."""

    def __init__(self, store: dist.Store, rank: int, world: int) -> None:
        super().__init__(name="hsdp-liveness", daemon=True)
        self.store, self.rank, self.world = store, rank, world
        self.stopped = False
        self.next_probe = 1

    def run(self) -> None:
        n = 1
        try:
            while True:
                self.store.wait([f"{_KEY}/probe/{n}/{self.rank}"], _WAIT)
                if self.stopped:
                    return
                self.store.set(f"{_KEY}/{n}/{self.rank}", "")
                n = self.next_probe = n + 1
        except Exception:  # noqa: BLE001 - the store is gone: nothing left to answer
            return

    def stop(self) -> None:
        self.stopped = True
        try:  # through the main client: this thread's is busy in its wait
            _probe(dist.distributed_c10d._get_default_store(), self.next_probe, [self.rank])
        except Exception:  # noqa: BLE001 - the store is gone, and the thread with it
            pass
        self.join(timeout=PROBE_S)


def start() -> None:
    """Answer probes from this world's ranks (once per world; no-op without a store that
    can be shared across threads, or for the fake backend)."""
    global _responder, _exit_hook
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    if not _exit_hook:  # before the interpreter's teardown (atexit: before finalization)
        atexit.register(stop)
        _exit_hook = True
    rank, world = dist.get_rank(), dist.get_world_size()
    if _responder is not None and _responder.is_alive() and \
            (_responder.rank, _responder.world) == (rank, world):
        return
    stop()
    try:
        store = dist.distributed_c10d._get_default_store().clone()
    except (RuntimeError, AttributeError):  # a store without clients of its own
        _responder = None
        return
    _responder = _Responder(store, rank, world)
    _responder.start()


def stop() -> None:
    """End this rank's responder (while the world's store still answers)."""
    global _responder
    if _responder is not None and _responder.is_alive():
        _responder.stop()
    _responder = None
    _found.clear()


def _probe(store: dist.Store, n: int, ranks: list[int]) -> None:
    store.multi_set([f"{_KEY}/probe/{n}/{r}" for r in ranks], [""] * len(ranks))


def gone_message() -> str:
    """A sentence naming the ranks that no longer answer ("" if all do, or if this world
    has no responders). Blocks up to PROBE_S; once a rank was found gone, the answer is
    remembered."""
    if _responder is None or not dist.is_initialized():
        return ""
    world = (dist.get_rank(), dist.get_world_size())
    if world in _found:
        return _found[world]
    store = dist.distributed_c10d._get_default_store()
    try:
        n = store.add(f"{_KEY}/probes", 1)
        _probe(store, n, list(range(world[1])))
        deadline = time.monotonic() + PROBE_S
        keys = [f"{_KEY}/{n}/{r}" for r in range(world[1])]
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = [r for r, k in enumerate(keys) if not store.check([k])]
        # The first finding stays the answer: ranks that end on their errors later must
        # not hide the one that died first.
        first = store.compare_set(f"{_KEY}/first", "", json.dumps(gone) if gone else "")
        first = json.loads(first) if first else gone
    except Exception:  # noqa: BLE001 - the store itself is gone
        message = ("The default store no longer answers: the process that serves it (rank "
                   "0's, unless MASTER_ADDR names another host) died or ended on an error.")
    else:
        if not gone:
            return ""
        message = (f"Rank(s) {first} stopped answering hsdp's liveness probe first: they "
                   f"died or hang.")
        if set(gone) - set(first):
            message += f" Rank(s) {sorted(set(gone) - set(first))} have ended since."
    _found[world] = message
    return message


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective or store that lost a peer."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        t in text for t in ("Connection reset", "Connection closed", "Broken pipe",
                            "Timed out", "timed out", "NCCL"))


def note_gone(exc: BaseException) -> None:
    """Add a note naming the ranks that are gone to a communication error (once)."""
    if is_peer_failure(exc) and "liveness probe" not in str(exc):
        message = gone_message()
        if message and message not in getattr(exc, "__notes__", ()):
            exc.add_note(f"hsdp: {message}")
