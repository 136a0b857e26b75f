"""The compressed outer reduction's error-feedback residual around steps whose gradients
never reach the optimizer, on 4 CPU ranks (2x2, gloo): a NaN, inf or 1e30 on one rank at
one step that the loop skips, gradients cleared without a step, saves after such a step.
The reference of each: the run in which that step never happened (tests/residual_jobs.py)."""

from __future__ import annotations

import pytest
from dist_utils import run_jobs, same_on_every_rank
from residual_jobs import accumulation_job, cleared_job, save_job, skipped_step_job

from hsdp.sharding.compressed import LIMIT

EQUAL = {"later_norms_equal": True, "later_norms_finite": True, "params_equal": True,
         "residuals_equal": True}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, list]:
    return run_jobs(4, {"skipped": (skipped_step_job, ()), "cleared": (cleared_job, ()),
                        "save": (save_job, (str(tmp_path_factory.mktemp("nonfinite")),)),
                        "accumulation": (accumulation_job, ())})


@pytest.mark.parametrize("case", ["int8-hsdp-nan", "fp8_e4m3-hsdp-nan", "int8-hsdp-inf",
                                  "int8-hfsdp-nan"])
def test_a_skipped_non_finite_step_leaves_no_trace(case: str, jobs: dict) -> None:
    """As with the exact reduction: the later steps are those of the run without it."""
    r = same_on_every_rank(jobs["skipped"])
    assert r["exact-hsdp-nan"] == EQUAL  # the exact reduction's behaviour, for reference
    assert r[case] == EQUAL


@pytest.mark.parametrize("case", ["int8-hsdp-1e+30", "fp8_e4m3-hfsdp-1e+30"])
def test_a_skipped_huge_outlier_leaves_no_trace(case: str, jobs: dict) -> None:
    r = same_on_every_rank(jobs["skipped"])
    assert r[case] == EQUAL


@pytest.mark.parametrize("case", ["hsdp-True", "hfsdp-True", "hsdp-False", "hfsdp-False"])
def test_gradients_cleared_without_a_step_leave_the_residual(case: str, jobs: dict) -> None:
    """zero_grad (set_to_none True / False) after a backward, no step, then two accumulated
    backwards and a step: the run without the first backward."""
    r = same_on_every_rank(jobs["cleared"])
    assert r[case] == EQUAL


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_no_non_finite_value_enters_the_residual(fmt: str, jobs: dict) -> None:
    r = same_on_every_rank([{k: v for k, v in x.items() if k.startswith(fmt)}
                            for x in jobs["save"]])
    assert r[f"{fmt}-saved"] == {"finite": True, "unchanged": True, "next_norm_finite": True}
    assert r[f"{fmt}-stepped"] == {"finite": True, "next_norm_finite": True}



@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_error_feedback_telescopes_over_accumulated_backwards(strategy: str,
                                                              jobs: dict) -> None:
    """A discarded backward, then two accumulated ones and a step: gradient + mean
    residual after = exact gradient + mean residual before, to fp32 rounding (1e-7 of
    the largest gradient), where counting a residual twice or keeping the discarded
    one's would be off by about the residual (1e-4 to 3e-3 of it)."""
    for violation, residual in (r[strategy] for r in jobs["accumulation"]):
        assert violation < 1e-6 and residual > 1e-5, (violation, residual)


def test_no_residual_value_squares_past_fp32(jobs: dict) -> None:
    """A 1e30 outlier's step taken anyway: no residual value whose square overflows fp32
    (every later norm over it would be inf); its rounding was 1e23."""
    assert all(r["outlier-stepped-largest"] <= LIMIT for r in jobs["save"])
