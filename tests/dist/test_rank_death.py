"""A rank that dies in the middle of hsdp's work is named in the survivors' errors (gloo,
CPU; rank_death_jobs.py)."""

from __future__ import annotations

from rank_death_jobs import run_with_a_death, save_death_job, tp_step_death_job


def test_rank_0_dying_in_a_save_is_named_in_hsdp_error(tmp_path) -> None:
    """Rank 0 serves the default store, where the save's meeting points leave their keys:
    once, the survivors got the store's raw ``DistNetworkError: Broken pipe``."""
    results = run_with_a_death(save_death_job, 4, str(tmp_path), 0)
    assert sorted(results) == [1, 2, 3], results
    for r in results.values():
        assert r.startswith("CheckpointError: hsdp.save of ") and "rank 0" in r, r


def test_rank_5_dying_in_a_tp_step_is_named_by_every_survivor() -> None:
    """Rank 5 of 2 (outer) x 2 (inner) x 2 (TP) exits before a step: each survivor fails
    in its own place (a TP collective of its forward or of hsdp's gradient hook, an hsdp
    stream, a timeout), and each error names rank 5 as the first rank gone. Once, the
    errors named no rank, or rank 4 (the first to give up). While all lived, the probe
    named none."""
    results = run_with_a_death(tp_step_death_job, 8, 5)
    assert sorted(results) == [0, 1, 2, 3, 4, 6, 7], results
    for rank, (alive, error) in results.items():
        assert alive == "", (rank, alive)
        assert "Rank(s) [5] stopped answering hsdp's liveness probe first" in error, (rank, error)
