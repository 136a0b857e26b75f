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
    rank naming a's job, a publishes, and the path loads as a's checkpoint."""
    for r in race["b"]:
        assert r[case].startswith("CheckpointBusyError") and "being saved by another job" \
            in r[case] and "pid" in r[case] and ".lock" in r[case], r[case]
    for r in race["a"]:
        assert r[case] == "ok", r[case]
    for r in race["a"] + race["b"]:
        assert r[f"{case}_loads"] == "a", r[f"{case}_loads"]


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


def test_no_lock_is_left_behind(race: dict) -> None:
    for r in race["a"] + race["b"]:
        assert r["lock_left"] == [], r["lock_left"]


def test_torch_dcp_in_the_same_race(race: dict) -> None:
    """The peer: two dcp.save to one directory both return, and it loads (b's data under a's
    metadata, the files having the same names and layout): last writer wins, no lock."""
    for r in race["a"] + race["b"]:
        assert r["dcp"] == "ok", r["dcp"]
        assert r["dcp_loads"] in ("a", "b"), r["dcp_loads"]
