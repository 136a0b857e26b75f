"""Saving never changes training; a load checks everything before it changes anything;
a checkpoint's files belong together (CPU, gloo, 4 ranks on 2x2, one spawned world)."""

from __future__ import annotations

import pytest
from ckpt_invariance_jobs import OPTIMIZERS, invisible_saves_job
from dist_utils import run_jobs

WORLD = 4


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, list[dict]]:
    return run_jobs(WORLD, {
        "invisible": (invisible_saves_job, (str(tmp_path_factory.mktemp("invisible")),))})


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_saving_every_step_changes_nothing(jobs: dict[str, list[dict]], kind: str) -> None:
    for r in jobs["invisible"]:
        res = r[kind]
        assert res["late_without_state"] and res["late_trained"], res  # the case is there
        assert res["equal_at_1"] and res["equal"], res
        assert res["resumed_equal"], res
