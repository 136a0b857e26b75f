"""``HSDPModule.set_gradient_divide_factor`` (FSDP2's meaning: 1.0 gives sums over the DP
ranks) on a 2x2 gloo mesh, against one process (divide_factor_jobs.py)."""

from __future__ import annotations

import pytest
import torch.nn as nn
from dist_utils import run_ranks
from divide_factor_jobs import divide_factor_job


def test_divide_factor_gives_sums_over_ranks_divided_by_it():
    per_rank = run_ranks(divide_factor_job, 4)
    bad = {k: e for r in per_rank for k, e in r.items() if not e < 1e-5}
    assert not bad, bad
    assert len(per_rank[0]) == 16


def test_divide_factor_must_be_positive():
    import hsdp.module

    module = nn.Linear(2, 2)
    hsdp.module.adopt(module)
    with pytest.raises(ValueError, match="positive factor"):
        module.set_gradient_divide_factor(0.0)
