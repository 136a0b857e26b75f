"""Checkpoints resumed in another outer-axis mode (exact, int8 with error feedback, DiLoCo
mid-period or at a sync), on the same mesh and another, by hsdp.load and by torch DCP:
every pair (the long tier; the default tier runs three in test_extra_state's world)."""

from __future__ import annotations

import pytest
from dist_utils import run_jobs
from mode_switch_jobs import check, switch_job


@pytest.mark.full
def test_every_mode_pair_resumes_by_the_rule(tmp_path) -> None:
    """torch DCP once raised "Missing key in checkpoint state_dict" for every switch into
    int8 or DiLoCo (and a DiLoCo / int8 checkpoint on another mesh), and every load
    dropped residuals or DiLoCo state without a word."""
    check(run_jobs(4, {"switch": (switch_job, (str(tmp_path),))})["switch"])
