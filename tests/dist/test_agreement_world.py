"""Ranks must agree before hsdp acts (docs/guide/failure_semantics.md), on 4 gloo ranks (2x2):
init_mesh's and expert_mesh's arguments, the model given to fully_shard, a peer stalled in
clip_grad_norm_; and a world re-created in one process gets new groups and leaks nothing.
Job bodies: ``world_jobs.py``."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from world_jobs import (
    MISMATCHES,
    TIMEOUT_S,
    clip_stall_job,
    expert_mesh_args_job,
    mesh_args_job,
    model_mismatch_job,
    reinit_job,
)

WORLD = 4
JOB_TIMEOUT_S = 300
TOL = 1e-5
# What each mismatch's error must name (rank 0's setting and rank 3's).
NAMED = {
    "head": ["unit <root>", "parameter 2.weight", "(1, 8)", "(2, 8)"],
    "strategy": ["strategy='hsdp'", "strategy='hfsdp'"],
    "mp_policy": ["param_dtype=None", "param_dtype=torch.float64"],
    "overlap": ["overlap_outer=True", "overlap_outer=False"],
    "units": ["3 units", "2 units"],
}


@pytest.fixture(scope="module")
def mismatches() -> list[dict]:
    return run_ranks(model_mismatch_job, WORLD, timeout=JOB_TIMEOUT_S)


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_ranks_with_different_models_raise_naming_the_first_difference(mismatches, case):
    for r, res in enumerate(mismatches):
        msg = res[case]
        assert msg.startswith("hsdp:") and "rank 3" in msg, (r, msg)
        for part in NAMED[case]:
            assert part in msg, (r, part, msg)
    assert len({res[case] for res in mismatches}) == 1  # the same message on every rank


def test_agreeing_ranks_train_as_one_process(mismatches):
    assert all(res["rel_err"] < TOL for res in mismatches), [r["rel_err"] for r in mismatches]


def test_ranks_disagreeing_on_init_mesh_raise_within_the_timeout():
    results = run_ranks(mesh_args_job, WORLD, timeout=JOB_TIMEOUT_S)
    for r, res in enumerate(results):
        msg = res["shape"]
        assert msg.startswith("hsdp:"), (r, msg)
        assert "rank 0: init_mesh(outer=2, inner=2" in msg, (r, msg)
        assert "ranks 1-3: init_mesh(outer=1, inner=4" in msg, (r, msg)
        assert res["shape seconds"] < TIMEOUT_S + 2, (r, res)
        assert res["agreed"] == "built" and res["shape after"] == (2, 2), (r, res)
    for r, res in enumerate(results[:3]):
        assert res["absent"].startswith("hsdp:") and "rank(s) [3]" in res["absent"], (r, res)
        assert res["absent seconds"] < 2 * TIMEOUT_S + 2, (r, res)
    assert results[3]["absent"] == "built"


def test_ranks_disagreeing_on_expert_mesh_raise_within_the_timeout():
    """Once, rank 0 (ep=2) hung building its groups past 150 s while the others (ep=4)
    got a raw DistStoreError."""
    results = run_ranks(expert_mesh_args_job, WORLD, timeout=JOB_TIMEOUT_S)
    for r, res in enumerate(results):
        msg = res["ep"]
        assert msg.startswith("hsdp: the ranks called expert_mesh with different"), (r, msg)
        assert "rank 0: expert_mesh(mesh of dims ('outer', 'inner'), shape (1, 4), ep=2)" \
            in msg and "ranks 1-3: expert_mesh(" in msg and "ep=4)" in msg, (r, msg)
        assert res["ep seconds"] < TIMEOUT_S + 2, (r, res)
        assert res["agreed"] == "built" and res["shape after"] == (1, 2, 2), (r, res)
    for r, res in enumerate(results[:3]):
        assert res["absent"].startswith("hsdp:") and "rank(s) [3]" in res["absent"], (r, res)
        assert res["absent seconds"] < 2 * TIMEOUT_S + 2, (r, res)
    assert results[3]["absent"] == "built"


def test_a_peer_stalled_in_clip_grad_norm_is_named_with_the_step():
    results = run_ranks(clip_stall_job, WORLD, timeout=JOB_TIMEOUT_S)
    for r, res in enumerate(results[:3]):
        msg = res.get("error", "")
        assert msg.startswith("hsdp:") and "rank(s) [3]" in msg and "step 1" in msg, (r, msg)
        assert res["seconds"] < 3 * TIMEOUT_S + 2, (r, res)


def test_a_re_created_world_gets_new_groups_and_leaks_nothing(tmp_path):
    worlds = 6
    results = run_ranks(reinit_job, WORLD, str(tmp_path), worlds, timeout=JOB_TIMEOUT_S)
    for r, res in enumerate(results):
        assert not any(res["stale"]), (r, res["stale"])
        assert all(res["reused"]), (r, res["reused"])
        assert all(e < TOL for e in res["rel_err"]), (r, res["rel_err"])
        # From the second world on (hsdp's stream threads exist): flat.
        counts = list(zip(*res["worlds"][1:], *res["meshes"]))
        for what, n, slack in zip(("python threads", "threads", "fds"), counts, (1, 2, 4)):
            assert max(n) - min(n) <= slack, (r, what, n)
