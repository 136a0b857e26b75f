"""A rank that dies in the middle of hsdp's work is named in the survivors' errors (gloo,
CPU; rank_death_jobs.py)."""

from __future__ import annotations

from rank_death_jobs import run_with_a_death, save_death_job


def test_rank_0_dying_in_a_save_is_named_in_hsdp_error(tmp_path) -> None:
    """Rank 0 serves the default store, where the save's meeting points leave their keys:
    once, the survivors got the store's raw ``DistNetworkError: Broken pipe``."""
    results = run_with_a_death(save_death_job, 4, str(tmp_path), 0)
    assert sorted(results) == [1, 2, 3], results
    for r in results.values():
        assert r.startswith("CheckpointError: hsdp.save of ") and "rank 0" in r, r
