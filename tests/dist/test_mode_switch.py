"""Checkpoints resumed in another outer-axis mode (exact, int8 with error feedback, DiLoCo
mid-period or at a sync), on the same mesh and another, by hsdp.load and by torch DCP:
every pair (the long tier; the default tier runs three in test_extra_state's world)."""

from __future__ import annotations

import statistics

import pytest
from dist_utils import run_jobs
from mode_switch_jobs import check, converge_job, switch_job


@pytest.mark.full
def test_every_mode_pair_resumes_by_the_rule(tmp_path) -> None:
    """torch DCP once raised "Missing key in checkpoint state_dict" for every switch into
    int8 or DiLoCo (and a DiLoCo / int8 checkpoint on another mesh), and every load
    dropped residuals or DiLoCo state without a word."""
    check(run_jobs(4, {"switch": (switch_job, (str(tmp_path),))})["switch"])


@pytest.mark.full
def test_switching_exact_int8_diloco_exact_across_resumes_converges(tmp_path) -> None:
    """The short form of scripts/mode_switch_convergence.py (8 gloo ranks, 2 seeds, 80
    steps): the switched run's first phase is the exact run's bit for bit, after every
    resume each step's loss stays within 10 % of the exact run's on the same batch (a load
    that kept nothing restarts near ln(vocab) = 4.85, three times the loss by then), and
    the last 10 steps' mean is within 2 % of the exact run's."""
    steps = 80
    curves = run_jobs(8, {"c": (converge_job, (str(tmp_path), steps))})["c"][0]
    for seed in (0, 1):
        exact = curves[f"4x2 hsdp/seed{seed}/exact"]
        switched = curves[f"4x2 hsdp/seed{seed}/switched"]
        quarter = steps // 4
        assert switched[:quarter] == exact[:quarter], seed
        worst = max(abs(s / e - 1) for s, e in zip(switched[quarter:], exact[quarter:]))
        assert worst < 0.1, (seed, worst)
        assert abs(statistics.fmean(switched[-10:]) / statistics.fmean(exact[-10:]) - 1) < 0.02, (
            seed, switched[-10:], exact[-10:])
