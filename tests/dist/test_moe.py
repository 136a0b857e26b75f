"""Mixture-of-experts with expert parallelism: experts sharded by hsdp on their own
(outer, inner, ep) mesh, nested inside the blocks' units on the (outer, inner) = (2, 4) gloo
mesh, ep 2, equal one process and FSDP2 on the same meshes (moe_jobs.py).

ONE spawned 8-rank job runs every check (process start-up dominates on two cores).
"""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from moe_jobs import parity_job

TOL = 1e-5  # fp32, SGD with momentum, 3 steps
BF16_FSDP2_TOL = 1e-3  # bf16 against FSDP2 in bf16


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(parity_job, 8, str(tmp_path_factory.mktemp("moe") / "ckpt"))


def test_expert_mesh_is_torchtitans_layout(results: list[dict]) -> None:
    """ep fastest inside each inner group: the experts of ep index x are sharded over the
    ranks of that index in each inner group, replicated over outer."""
    assert results[0]["mesh"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_nested_expert_units_match_one_process_and_fsdp2(results: list[dict]) -> None:
    """hsdp (clip by hsdp.clip_grad_norm_) and hfsdp (2 microbatches, activation
    checkpointing, torchtitan's per-mesh clip) against one process and FSDP2, and hsdp on
    ep 4 (expert inner groups of one rank) and ep 1 (a 3-D mesh whose ep dim has one
    rank: raised IndexError); gradient norms
    as one process's: every expert counted once, over the ep ranks that hold different
    experts. bf16 for compute: as FSDP2 with the same policy (not as one process)."""
    for r in results:
        assert r.pop("bf16 hsdp vs fsdp2") < BF16_FSDP2_TOL, r
        assert r.pop("bf16 fsdp2 vs ref") > TOL, r  # bf16 was in effect
        errs = {k: v for k, v in r.items() if k.endswith(("vs ref", "vs fsdp2"))}
        assert len(errs) == 9 and all(v < TOL for v in errs.values()), errs
        for k in [k for k in r if k.endswith("norms")]:
            assert r[k] == pytest.approx(r["ref norms"], rel=TOL), k
        assert min(r["ref norms"]) > 0.05  # clipping was active


def test_dcp_checkpoint_reshards_between_ep_degrees_and_resumes(results: list[dict]) -> None:
    for r in results:
        assert r["ep=2 ckpt -> ep=4 equal"] and r["ep=2 ckpt -> ep=2 equal"], r
        assert r["resume bit for bit"], r


def test_refused_before_sharding(results: list[dict]) -> None:
    errors = results[0]["errors"]
    assert all(r["errors"] == errors for r in results)
    assert "ep=3 must be a positive divisor of the inner size 4" in errors[0]
    assert "weight is not sharded over expert parallelism" in errors[1]
    assert "expert parallelism with fault_tolerance or outer_sync" in errors[2]
