"""Saving never changes training; a load checks everything before it changes anything;
a checkpoint's files belong together (CPU, gloo, 4 ranks on 2x2, one spawned world)."""

from __future__ import annotations

import pytest
from ckpt_invariance_jobs import (
    OPTIMIZERS,
    all_or_nothing_job,
    binding_job,
    invisible_saves_job,
)
from dist_utils import run_jobs

WORLD = 4


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, list[dict]]:
    return run_jobs(WORLD, {
        "invisible": (invisible_saves_job, (str(tmp_path_factory.mktemp("invisible")),)),
        "all_or_nothing": (all_or_nothing_job, (str(tmp_path_factory.mktemp("aon")),)),
        "binding": (binding_job, (str(tmp_path_factory.mktemp("binding")),))})


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_saving_every_step_changes_nothing(jobs: dict[str, list[dict]], kind: str) -> None:
    for r in jobs["invisible"]:
        res = r[kind]
        assert res["late_without_state"] and res["late_trained"], res  # the case is there
        assert res["equal_at_1"] and res["equal"], res
        assert res["resumed_equal"], res


@pytest.mark.parametrize("case,message", [
    ("groups", "has 2 optimizer parameter group(s), this optimizer 1"),
    ("class", "hyperparameters"),
    ("dtype", "is torch.float32 in the checkpoint"),
    ("one_rank", "injected on rank 2")])
def test_a_failed_load_changes_nothing_on_any_rank(jobs: dict[str, list[dict]], case: str,
                                                   message: str) -> None:
    for r in jobs["all_or_nothing"]:
        assert r[case].startswith("ValueError") and message in r[case], r[case]
        assert r[f"{case}_unchanged"], r
        assert r["good_load"], r


def test_optimizers_without_a_built_initial_state(jobs: dict[str, list[dict]]) -> None:
    for r in jobs["all_or_nothing"]:
        assert r["rms_get_state_dict"].startswith("ValueError") and \
            "cannot build RMSprop's initial state" in r["rms_get_state_dict"], r
        assert r["rms_fresh_loads_without_state"] and r["rms_round_trip"], r


@pytest.mark.parametrize("case,message", [
    ("foreign_shard", ".hsdp-checksums.1.json is from another checkpoint"),
    ("foreign_metadata", "is from another checkpoint"),
    ("swapped", ".metadata does not match the checksum in .hsdp-seal.json")])
def test_files_of_another_save_or_an_edited_metadata_are_refused(
        jobs: dict[str, list[dict]], case: str, message: str) -> None:
    for r in jobs["binding"]:
        assert r[case].startswith("CheckpointError") and message in r[case], r[case]
        assert r[f"{case}_unchanged"], r
        assert r["good_load"], r


def test_metadata_is_unpickled_once_per_load(jobs: dict[str, list[dict]]) -> None:
    for r in jobs["binding"]:
        assert r["metadata_unpickled"] == 1, r
