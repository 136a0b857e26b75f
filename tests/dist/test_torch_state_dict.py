"""torch's state-dict helpers, DCP with FSDP2, pickling on hsdp models (CPU, gloo, 2x2)."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from torch_sd_jobs import torch_sd_job

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(torch_sd_job, 4, str(tmp_path_factory.mktemp("torch_sd")))


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
