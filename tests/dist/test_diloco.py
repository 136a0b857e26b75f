"""DiLoCo on the outer axis (``init_mesh(outer_sync=hsdp.DiLoCo(...))``) on 8 CPU ranks
(4 outer x 2 inner, gloo): H=1 equals synchronous hsdp, H=10 stays close while syncing
10x less, resume from a checkpoint equals the uninterrupted run, bad settings are refused
on every rank (with fault tolerance too: tests/dist/test_ft_diloco.py)."""

from __future__ import annotations

import pytest
from diloco_jobs import CLIP, compose_job, equivalence_job, errors_job, h10_job, resume_job
from dist_utils import run_jobs, same_on_every_rank

TOL = 1e-5  # relative, fp32: reduction order only
BF16_TOL = 1e-4  # bf16 parameters: main rounded differently can flip a bf16 cast


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, list]:
    return run_jobs(8, {"equivalence": (equivalence_job, ()), "h10": (h10_job, ()),
                        "resume": (resume_job, (str(tmp_path_factory.mktemp("diloco")),)),
                        "errors": (errors_job, ()), "compose": (compose_job, ())})


@pytest.mark.parametrize("fragments", [1, 3])
def test_h1_equals_synchronous_hsdp(jobs: dict, fragments: int) -> None:
    for r in jobs["equivalence"]:
        e = r[f"F{fragments}"]
        assert e["rel"] < TOL, e
        assert e["outer_per_group_step"] == 1.0, e  # one pseudo-gradient all-reduce each


def test_pseudo_gradients_compress_with_outer_reduce(jobs: dict) -> None:
    for r in jobs["equivalence"]:
        e = r["int8"]
        assert TOL < e["rel"] < 1e-2, e  # it quantized, within 8 bits' error
        assert e["outer_per_group_step"] == 2.0, e  # all-to-all + all-gather, no all-reduce


@pytest.mark.parametrize("name", ["F1", "F3", "F1d2"])
def test_h10_stays_close_to_synchronous_hsdp(jobs: dict, name: str) -> None:
    r = jobs["h10"][0]
    sync, run = r["sync"], r[name]
    assert all(x[name] == run for x in jobs["h10"])  # the same on every rank
    assert sync[0] - sync[-1] > 1.0, sync  # it learns
    assert run["losses"][0] - run["losses"][-1] > 1.0, run["losses"]
    assert abs(sum(run["losses"][-5:]) - sum(sync[-5:])) / 5 < 0.25, (run["losses"], sync)
    assert run["outer_per_group"] == 3  # 30 steps / H=10: three syncs per group, no AR
    assert run["mid_period_differs"], run
    # after step 30: F=1's one fragment has just synced; F=3's syncs are staggered (3, 6,
    # 10); with delay 2 the step-30 sync is applied after step 32
    assert run["synced_at_end"] == (name == "F1"), run
    assert run.get("synced_after_delay", True), run


def test_resume_equals_the_uninterrupted_run(jobs: dict) -> None:
    for r in jobs["resume"]:
        assert r == {"resumed_equal": True, "control_differs": True}


def test_bad_settings_are_refused_on_every_rank(jobs: dict) -> None:
    r = same_on_every_rank(jobs["errors"])
    assert r["H0"].startswith("ValueError: hsdp.DiLoCo: inner_steps must be an int >= 1")
    assert r["F0"].startswith("ValueError: hsdp.DiLoCo: fragments must be an int >= 1")
    assert r["lr"].startswith("ValueError: hsdp.DiLoCo: outer_lr must be a number > 0")
    assert r["momentum"].startswith("ValueError: hsdp.DiLoCo: momentum must be a number in")
    assert r["delay"].startswith("ValueError: hsdp.DiLoCo: delay must be an int in [0, "
                                 "inner_steps=4)")
    assert r["type"].startswith("TypeError: init_mesh: outer_sync must be an hsdp.DiLoCo")
    assert r["ft_delay"].startswith("FaultToleranceError: init_mesh: outer_sync=DiLoCo("
                                    "inner_steps=4, fragments=2, delay=3) with "
                                    "fault_tolerance: each sync is one torchft quorum")
    assert r["ft_async"].startswith("FaultToleranceError: init_mesh: outer_sync=DiLoCo(...) "
                                    "with a torchft Manager made with use_async_quorum=True")
    assert r["hfsdp"].startswith("ValueError: fully_shard: strategy='hfsdp' cannot train")
    assert r["fragments"].startswith("ValueError: hsdp.DiLoCo: fragments=2 does not divide "
                                     "the model's 3 fully_shard units")
    assert r["optimizer"].startswith("ValueError: hsdp.DiLoCo: this optimizer does not hold")
    assert r["fragments_unchanged"] == r["optimizer_unchanged"] == "True"


def test_composes_with_fp8_microbatches_mixed_precision_and_clip(jobs: dict) -> None:
    """H=1 (synchronous): fp8 pseudo-gradients within 8 bits' error; 2 microbatches and
    bf16 parameters equal synchronous hsdp with the same; ``clip_grad_norm_`` clips each
    replica's own gradient (one process averaging the replicas' clipped updates)."""
    for r in jobs["compose"]:
        assert TOL < r["fp8"] < 1e-2, r
        assert r["mb2"] < TOL and r["bf16"] < BF16_TOL and r["clip"] < TOL, r
        assert r["min_norm"] > 1.5 * CLIP, r  # every replica was clipped
