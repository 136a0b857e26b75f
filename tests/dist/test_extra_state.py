"""hsdp's residual and DiLoCo state through torch's state-dict API and DCP, DiLoCo
checkpoints saved mid-period, and loads across layouts (CPU, gloo, 2x2)."""

from __future__ import annotations

import pytest
from dist_utils import run_jobs
from extra_state_jobs import layouts_job, mid_period_job, torch_api_job
from mode_switch_jobs import check, switch_job

# a switch into int8 and into DiLoCo by torch DCP, out of DiLoCo mid-period by hsdp.load
SWITCHES = [("exact", "int8", (2, 2), "torch"), ("int8", "diloco", (2, 2), "torch"),
            ("diloco_mid", "exact", (2, 2), "hsdp")]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every job in ONE spawned world."""
    root = str(tmp_path_factory.mktemp("extra_state"))
    return run_jobs(4, {"torch": (torch_api_job, (root,)),
                        "mid": (mid_period_job, (root,)),
                        "layouts": (layouts_job, (root,)),
                        "switch": (switch_job, (root, SWITCHES))})


def test_int8_residual_travels_through_torch_get_set_state_dict(jobs) -> None:
    """Once 0 residual keys reached DCP and the resumed run was off by 2e-3."""
    for r in jobs["torch"]:
        got = r["int8"]
        assert got["flat_has_residual"], got
        assert got["resumed_equal"] and got["residual_equal"], got
        assert "full_state_dict" in got["full_error"], got
        assert "another mesh" in got["bad_error"] and got["bad_unchanged"], got


def test_diloco_resumes_bit_exact_through_torch_get_set_state_dict(jobs) -> None:
    for r in jobs["torch"]:
        assert r["diloco"]["resumed_equal"], r["diloco"]


def test_mid_period_diloco_checkpoint_loads_replica_0(jobs) -> None:
    """DCP's dedup once picked a writer per chunk: each weight matched no replica."""
    for r in jobs["mid"]:
        assert r.pop("replicas_differ"), r
        assert all(r.values()), r


def test_residual_loads_across_layouts_all_or_nothing(jobs) -> None:
    """hsdp int8 -> hfsdp int8 once wrote the model and optimizer, then raised a raw
    "shape '[2, 144]' is invalid" from the residual."""
    for r in jobs["layouts"]:
        for name, got in r.items():
            assert got["finite"] and got["kept"], (name, got)
            if got["error"] != "no error":
                assert got["unchanged"] and "hsdp" in got["error"], (name, got)


def test_switching_mode_on_resume_follows_the_rule(jobs) -> None:
    """torch DCP once raised "Missing key in checkpoint state_dict" into int8 or DiLoCo,
    and loads dropped residuals or DiLoCo state without a word (every pair:
    test_mode_switch.py)."""
    check(jobs["switch"])
