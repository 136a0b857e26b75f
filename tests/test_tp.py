"""hsdp with tensor parallelism on an (outer, inner, tp) = (2, 2, 2) CPU gloo mesh: a tiny
Llama-style model with torchtitan's TP plan equals one process and FSDP2 + the same plan.

ONE spawned 8-rank job runs every case (process start-up dominates on two cores).
"""

from __future__ import annotations

import itertools

import pytest
from dist_utils import run_ranks
from tp_jobs import TPCase, parity_job

TOL = 1e-5  # fp32, SGD with momentum, 3 steps

FSDP2_CASES = [TPCase("fsdp2", True, mb) for mb in (1, 3)]
CASES = [TPCase(strategy, overlap, mb) for strategy, overlap, mb in itertools.product(
    ("hsdp", "hfsdp"), (True, False), (1, 3))]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(parity_job, 8, (2, 2, 2), FSDP2_CASES + CASES)


def test_init_mesh_3d(results: list[dict]) -> None:
    """tp fastest, then inner, then outer (torchtitan's layout); sizes that do not fit the
    world raise a ValueError that says so, on every rank."""
    names, ranks, _ = results[0]["mesh"]
    assert names == ("outer", "inner", "tp")
    assert ranks == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [r["mesh"][2] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5],
                                               [6, 7], [6, 7]]
    errors = results[0]["errors"]
    assert all(r["errors"] == errors for r in results)
    assert "outer*inner*tp = 3*1*2 = 6" in errors[0]
    assert "tp=3 does not divide" in errors[1]
    assert "tp must be a positive int" in errors[2]
    assert "outer*inner*tp = 1*2*2 = 4" in errors[3]


@pytest.mark.parametrize("case", FSDP2_CASES + CASES, ids=str)
def test_tp_parity(case: TPCase, results: list[dict]) -> None:
    errs = [r[case] for r in results]
    assert all(e == errs[0] for e in errs), f"ranks disagree: {errs}"
    assert errs[0]["ref"] < TOL, errs[0]
    if case.strategy != "fsdp2":
        assert errs[0]["fsdp2"] < TOL, errs[0]
