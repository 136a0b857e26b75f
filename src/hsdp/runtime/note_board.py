"""The note board: a rank that gives up a step (its forward or backward raised) or waits
unusually long for the step agreement leaves a note in the default store; a CPU rank
blocked on a collective that will never complete reads it while it waits
(``streams.POLL_S``) and raises instead of waiting for the timeout. (On CUDA the host does
not block on collectives: every rank reaches the agreement.)"""

from __future__ import annotations

import torch.distributed as dist


def _strength(note: str) -> tuple[int, int]:
    """Lower says more: a failure, then an end after fewer forwards ("KIND RANK FORWARDS")."""
    kind, _, forwards = note.split()
    return (0, 0) if kind == "failed" else (1, int(forwards))


def post_note(key: str, text: str) -> None:
    """Leave ``text`` ("KIND RANK FORWARDS") for peers blocked in this step (see the module
    docstring), unless the note there says more: a rank that ended the step after more
    microbatches must not hide the earlier end from ranks blocked in between."""
    if dist.get_backend() == "fake":
        return
    store = dist.distributed_c10d._get_default_store()
    current = store.get(key).decode() if store.check([key]) else ""
    while not current or _strength(text) < _strength(current):
        current = store.compare_set(key, current, text).decode()
        if current == text:
            return


def read_note(key: str) -> str | None:
    if dist.get_backend() == "fake":
        return None
    store = dist.distributed_c10d._get_default_store()
    return store.get(key).decode() if store.check([key]) else None
