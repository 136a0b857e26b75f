"""Ranks agreeing on what they are about to build, before they build it.

``init_mesh``'s arguments are compared through the default store (no group of hsdp's
exists yet, and a group made from different arguments hangs in ``new_group``); the model
``fully_shard`` built is compared at the root's first forward by one small all-reduce of a
hash on the CPU ``control`` group (the descriptions themselves are exchanged only when the
hashes differ). A mismatch raises the same hsdp error on every rank, naming what differs,
before any collective whose shape depends on it; a rank that does not take part within the
timeout is named by the others.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

# Process-wide: store keys must match the calls every rank made in this process.
# Store exchanges so far, per purpose: the same on every rank that made the same calls.
_CALLS: defaultdict[str, itertools.count] = defaultdict(itertools.count)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _by_value(values: list[str]) -> str:
    """'rank 0: a; ranks 1-3: b' (ranks grouped by what they said)."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{_ranks(rs)}: {v}" for v, rs in groups.items())


def agree_in_store(what: str, mine: str, timeout: timedelta, fix: str) -> None:
    """Every rank posts ``mine`` (a short description of its call to ``what``) in the
    default store; if any rank's differs from rank 0's, every rank raises naming each
    rank's, with ``fix``. A rank that does not post within ``timeout`` is named by the
    others (they raise after at most twice ``timeout``). O(world) store operations."""
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    base = f"hsdp/agree/{what}/{next(_CALLS[what])}"
    keys = [f"{base}/{r}" for r in range(world)]
    store.set(keys[rank], mine)
    try:
        store.wait([keys[0]], timeout)
        store.add(f"{base}/differ", int(store.get(keys[0]).decode() != mine))
        if store.add(f"{base}/arrived", 1) == world:
            store.set(f"{base}/all", "")
        store.wait([f"{base}/all"], timeout)
    except RuntimeError as exc:  # the store's timeout: some rank did not call it
        absent = [r for r in range(world) if not store.check([keys[r]])]
        raise RuntimeError(
            f"hsdp: {what}: rank(s) {absent} did not call it within the timeout "
            f"({timeout}) while the others did; every rank must call {what} with the same "
            f"arguments") from exc
    if store.add(f"{base}/differ", 0):
        said = [v.decode() for v in store.multi_get(keys)]
        raise ValueError(f"hsdp: the ranks called {what} with different arguments: "
                         f"{_by_value(said)}. {fix}")


def _digest(lines: list[str]) -> int:
    return int.from_bytes(hashlib.sha256("\n".join(lines).encode()).digest()[:7], "little")


def agree_on_group(what: str, lines: list[str], group: dist.ProcessGroup,
                   timeout: timedelta, fix: str) -> None:
    """Every rank of ``group`` (a CPU group over the world) must hold the same ``lines``
    (a description of ``what``); otherwise every rank raises naming the first line where
    some rank differs from rank 0, with ``fix``. One all-reduce of two int64s."""
    h = _digest(lines)
    t = torch.tensor([h, -h], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:  # gloo: a peer did not join in time
        raise RuntimeError(
            f"hsdp: the other ranks did not reach the check of {what} within the timeout "
            f"({timeout}): a rank died, is stuck, or does not run this model. hsdp's "
            f"communicators cannot be used any more: restart the job.") from exc
    if t[0] == -t[1]:
        return
    everyone: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, lines, group=group)
    n = max(len(ls) for ls in everyone)
    padded = [ls + ["(nothing)"] * (n - len(ls)) for ls in everyone]
    i = next(i for i in range(n) if len({ls[i] for ls in padded}) > 1)
    raise ValueError(f"hsdp: the ranks built different {what}s; the first difference: "
                     f"{_by_value([ls[i] for ls in padded])}. {fix}")
