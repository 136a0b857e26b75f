"""Reductions of sharded parameters and gradients give the unsharded model's values, or a
clear hsdp error on every rank (2x2 gloo mesh; reduction_jobs.py)."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from reduction_jobs import reductions_job


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_reductions_match_the_unsharded_model_or_refuse(strategy):
    per_rank = run_ranks(reductions_job, 4, strategy)
    assert all(r == per_rank[0] for r in per_rank), per_rank  # no rank-divergent outcome
    wrong = sorted(k for k, ok in per_rank[0].items() if not ok)
    assert not wrong, wrong
