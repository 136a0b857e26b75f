"""torch's state-dict helpers, DCP with FSDP2, pickling on hsdp models (CPU, gloo, 2x2)."""

from __future__ import annotations

import pytest
from dist_utils import run_jobs
from torch_sd_jobs import async_save_job, torch_sd_job

TOL = 1e-5


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, list[dict]]:
    """Both jobs in ONE spawned world (process start-up dominates on two cores)."""
    return run_jobs(4, {"sd": (torch_sd_job, (str(tmp_path_factory.mktemp("torch_sd")),)),
                        "async": (async_save_job, (str(tmp_path_factory.mktemp("async")),))})


@pytest.fixture(scope="module")
def results(jobs) -> list[dict]:
    return jobs["sd"]


def _errs(results: list[dict], prefix: str) -> dict[str, float]:
    got = {k: v for k, v in results[0].items() if k.startswith(prefix)}
    assert got, prefix
    return got


def test_dcp_with_torch_get_state_dict_loads_both_ways_with_fsdp2(results) -> None:
    errs = _errs(results, "dcp")
    assert len(errs) == 10
    assert all(v < TOL for v in errs.values()), errs


def test_full_state_dict_broadcast_from_rank0(results) -> None:
    errs = {**_errs(results, "from_rank0"), **_errs(results, "full:")}
    assert len(errs) == 8
    assert all(v < TOL for v in errs.values()), errs


def test_full_state_dict_errors_raise_on_every_rank(results) -> None:
    for r in results:
        assert "head.weight" in r["error/shape"] and "(3, 3)" in r["error/shape"], r
        assert "extra" in r["error/extra"], r
        assert r["error/unchanged"] is True


def test_pickled_and_deepcopied_state_dicts_load(results) -> None:
    errs = {**_errs(results, "torch.save"), **_errs(results, "deepcopy")}
    assert len(errs) == 10
    assert all(v < TOL for v in errs.values()), errs


def test_torch_async_save_in_a_thread_and_in_its_checkpoint_process_resumes(jobs) -> None:
    """torch's stager deep-copies tensors with their attributes, and its checkpoint process
    unpickles them where hsdp has no mesh: once the save of a Piece raised "cannot pickle
    'ProcessGroup' object" on every rank."""
    errs = _errs(jobs["async"], "async")
    assert len(errs) == 12
    assert all(v < TOL for v in errs.values()), errs
