"""Post-accumulate-grad hooks on hsdp parameters (optimizer-in-backward) and parameter
writes after a step, against a single process and torch FSDP2 (CPU, gloo, 2x2)."""

from __future__ import annotations

import itertools

import pytest
from dist_utils import run_jobs
from hook_jobs import hooks_job, writes_job

TOL = 1e-5

HOOK_CASES = list(itertools.product(("hsdp", "hfsdp"), (True, False), ("plain", "mb1", "mb3")))
WRITES = ("in_place", "copy_", "load_state_dict", "ema_lerp", "data", "to_local")
WRITE_CASES = list(itertools.product(("hsdp", "hfsdp"), WRITES))


@pytest.fixture(scope="module")
def jobs() -> dict[str, list[dict]]:
    """Both jobs in ONE spawned world (process start-up dominates on two cores)."""
    return run_jobs(4, {"hooks": (hooks_job, (HOOK_CASES,)),
                        "writes": (writes_job, (WRITE_CASES,))})


@pytest.fixture(scope="module")
def hooks(jobs: dict[str, list[dict]]) -> list[dict]:
    return jobs["hooks"]


@pytest.fixture(scope="module")
def writes(jobs: dict[str, list[dict]]) -> list[dict]:
    return jobs["writes"]


@pytest.mark.parametrize("case", HOOK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_optimizer_in_backward_matches_one_process(hooks: dict, case: tuple) -> None:
    for rank, res in enumerate(hooks):
        r = res[(*case, "hsdp")]
        # once per parameter and step, during backward, with the step's final gradient
        assert r["calls"] == [8] * 3 and r["all_params_each_step"], (rank, r)
        assert r["in_backward"], (rank, r)
        assert r["grad_err"] < TOL, (rank, r)
        # an optimizer stepping in the hooks trains as the reference's step does
        assert r["param_err"] < TOL, (rank, r)


@pytest.mark.parametrize("mode", ("plain", "mb1", "mb3"))
def test_hooks_run_as_fsdp2_runs_them(hooks: dict, mode: str) -> None:
    for rank, res in enumerate(hooks):
        mine, theirs = res[("hsdp", True, mode, "hsdp")], res[("hsdp", True, mode, "fsdp2")]
        assert theirs["grad_err"] < TOL and theirs["param_err"] < TOL, (rank, theirs)
        assert theirs["in_backward"] and mine["in_backward"]
        assert mine["calls"] == theirs["calls"], (rank, mine["calls"], theirs["calls"])
        assert mine["order"] == theirs["order"], (rank, mine["order"], theirs["order"])


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: "-".join(c))
def test_writes_after_step_are_kept(writes: dict, case: tuple) -> None:
    for rank, res in enumerate(writes):
        r = res[case]
        assert r["right_after"] < TOL and r["settled"] < TOL and r["final"] < TOL, (rank, r)
