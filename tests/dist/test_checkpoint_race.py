"""Two jobs saving to one checkpoint path at once (two gloo worlds of 2 ranks, run side by
side; ``ckpt_race_jobs.py`` places b's save inside a's with hooks, not timing): the path
always holds a checkpoint that loads, a save whose files are gone never reports success,
and the refused save gets ``CheckpointBusyError`` naming the other job. torch DCP in the
same situation is recorded for comparison."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt_race_jobs import race_job
from dist_utils import run_ranks

WORLD = 2


@pytest.fixture(scope="module")
def race(tmp_path_factory) -> dict[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("race"))
    with ThreadPoolExecutor(2) as pool:
        jobs = {role: pool.submit(run_ranks, race_job, WORLD, root, role) for role in "ab"}
        return {role: job.result() for role, job in jobs.items()}


@pytest.mark.parametrize("case", ["publish", "write"])
def test_a_second_save_to_a_path_being_saved_is_refused(race: dict, case: str) -> None:
    """b saves between a's write and its publish, or while a writes: b is refused on every
    rank naming a's job, a publishes, the path loads as a's checkpoint, no lock is left.
    (Before: both returned OK and the path pointed at files b had removed; or a failed
    saying the previous checkpoint was unchanged while b had replaced it.)"""
    for r in race["b"]:
        assert r[case].startswith("CheckpointBusyError") and "being saved by another job" \
            in r[case] and "pid" in r[case] and ".lock" in r[case], r[case]
    for r in race["a"]:
        assert r[case] == "ok", r[case]
    for r in race["a"] + race["b"]:
        assert r[f"{case}_loads"] == "a", r[f"{case}_loads"]
        assert r["lock_left"] == [], r["lock_left"]


def test_a_stale_lock_is_broken_and_its_save_is_not_published(race: dict) -> None:
    """a's lock went stale (a stopped process) between its write and its publish: b
    breaks it and publishes; a's publish then fails saying why instead of pointing the
    path at files b removed."""
    for r in race["b"]:
        assert r["stale"] == "ok", r["stale"]
    for r in race["a"]:
        assert r["stale"].startswith("CheckpointError") and "lock" in r["stale"] and \
            "not published" in r["stale"] and "unchanged" not in r["stale"], r["stale"]
    for r in race["a"] + race["b"]:
        assert r["stale_loads"] == "b", r["stale_loads"]


def test_a_failed_save_says_the_path_changed_when_it_did(race: dict) -> None:
    """a's lock went stale while it wrote: b broke it and published; a's error says the
    path was switched by another save, never that the previous checkpoint is unchanged.
    The peer, torch DCP, in the same race: both dcp.save return and the directory loads
    b's data under a's metadata (last writer wins, nothing refused)."""
    for r in race["b"]:
        assert r["stale_write"] == "ok", r["stale_write"]
    for r in race["a"]:
        msg = r["stale_write"]
        assert msg.startswith("CheckpointError") and "switched meanwhile by another save" \
            in msg and "unchanged" not in msg, msg
    for r in race["a"] + race["b"]:
        assert r["stale_write_loads"] == "b", r["stale_write_loads"]
        assert r["dcp"] == "ok" and r["dcp_loads"] == "b", (r["dcp"], r["dcp_loads"])
