"""Checkpoint safety (CPU, gloo, 4 ranks on 2x2): hsdp never replaces or removes what it did
not make, loads all or nothing, never drops an asynchronous save, and names a stalled
peer. The jobs run in ONE spawned world (process start-up dominates on two cores), except
the stalled peer's, whose default group has a short timeout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_safety_jobs import (
    STALL_PG_TIMEOUT_S,
    async_job,
    corrupt_job,
    paths_job,
    stall_job,
    unmarked_job,
)
from dist_utils import run_jobs, run_ranks

from hsdp_tools.models import GPT, GPTConfig

TOL = 1e-5
WORLD = 4


@pytest.fixture(scope="module")
def async_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("async")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, async_root: Path) -> dict[str, list[dict]]:
    """async_job last: its last save is finished by ``destroy_process_group``."""
    return run_jobs(WORLD, {
        "paths": (paths_job, (str(tmp_path_factory.mktemp("paths")),)),
        "corrupt": (corrupt_job, (str(tmp_path_factory.mktemp("corrupt")),)),
        "unmarked": (unmarked_job, (str(tmp_path_factory.mktemp("unmarked")),)),
        "async": (async_job, (str(async_root),))})


@pytest.fixture(scope="module")
def paths(jobs: dict[str, list[dict]]) -> list[dict]:
    return jobs["paths"]


def test_paths_hsdp_did_not_make_are_refused_and_left_alone(paths: list[dict]) -> None:
    for r in paths:
        assert r["latest"].startswith("FileExistsError") and "symlink hsdp did not make" \
            in r["latest"], r["latest"]
        assert r["latest2"].startswith("FileExistsError") and "-> keep" in r["latest2"], r
        assert r["notes.txt"].startswith("FileExistsError") and "a file" in r["notes.txt"], r
        assert r["user_unchanged"] and r["keep_loads"], r


def test_user_links_with_staging_names_are_never_written_through(paths: list[dict]) -> None:
    for r in paths:
        assert r["staged_save"] == "ok", r["staged_save"]
        assert r["staged_untouched"] and r["victim_empty"] and r["staged_loads"], r


def test_an_old_version_is_removed_only_when_nothing_points_at_it(paths: list[dict]) -> None:
    for r in paths:
        assert r["pin_loads_first"] and r["latest_loads_last"], r
        assert len(r["roll_dirs"]) == 2, r["roll_dirs"]  # the pinned first and the last


def test_a_unit_that_is_not_the_root_is_refused(paths: list[dict]) -> None:
    for r in paths:
        for what in ("unit_save", "unit_load"):
            assert r[what].startswith("ValueError") and "GPT" in r[what] \
                and "root" in r[what], r[what]
        assert r["unit_nothing_written"], r


@pytest.fixture(scope="module")
def corrupt(jobs: dict[str, list[dict]]) -> list[dict]:
    return jobs["corrupt"]


@pytest.mark.parametrize("what,name", [("truncated", "__0_0.distcp"),
                                       ("flipped", "__1_0.distcp"),
                                       ("missing", "__0_0.distcp")])
def test_a_damaged_file_fails_the_whole_load_naming_it(corrupt: list[dict], what: str,
                                                       name: str) -> None:
    for r in corrupt:
        assert r[what].startswith("CheckpointError") and name in r[what], r[what]
        assert r[f"{what}_unchanged"], r
        assert r["ref"] < TOL, r["ref"]  # restored, it resumes to the one-process run


@pytest.mark.parametrize("case,message", [
    ("flipped", "__1_0.distcp: corrupt"),
    ("foreign_shard", ".hsdp-checksums.1.json is from another checkpoint"),
    ("swapped", ".metadata does not match the checksum in .hsdp-seal.json"),
    ("no_seal", "its seal .hsdp-seal.json is missing"),
    ("no_seal_no_sums", "its seal .hsdp-seal.json is missing"),
    ("altered_seal", ".hsdp-seal.json is not an hsdp seal")])
def test_an_hsdp_checkpoint_is_recognised_without_its_marker(
        jobs: dict[str, list[dict]], case: str, message: str) -> None:
    """The empty marker file deleted: the checksums, the seal and the save ids are still
    checked (hsdp's save id is in the metadata), and a missing or altered seal is refused."""
    for r in jobs["unmarked"]:
        assert r[case].startswith("CheckpointError") and message in r[case], r[case]
        assert r[f"{case}_unchanged"], r
        assert r["unmarked_loads"] == "ok" and r["unmarked_equal"], r


def _read_model(path: str) -> dict[str, torch.Tensor]:
    """The model in an hsdp checkpoint, read by DCP in this one process."""
    state = {"model": GPT(GPTConfig()).state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


def test_async_saves_are_finished_never_dropped(jobs: dict[str, list[dict]],
                                                async_root: Path) -> None:
    results, tmp_path = jobs["async"], async_root
    for r in results:
        assert r["a_published"], r
        assert r["failed"].startswith("CheckpointError") and "disk full" in r["failed"], r
        assert r["f_absent"], r
    for name in ("a", "b"):  # b: finished by destroy_process_group
        assert os.path.islink(tmp_path / name), sorted(os.listdir(tmp_path))
        got, want = _read_model(str(tmp_path / name)), results[0][f"at_{name}"]
        assert all(torch.equal(got[k], want[k]) for k in want), name


def test_a_stalled_peer_is_named_in_hsdp_error(tmp_path) -> None:
    results = run_ranks(stall_job, WORLD, str(tmp_path), pg_timeout_s=STALL_PG_TIMEOUT_S)
    for r in results[:3]:
        assert r["error"].startswith("CheckpointError") and "rank(s) [3] never reached" \
            in r["error"], r
        assert r["seconds"] < 3 * STALL_PG_TIMEOUT_S + 5, r
