"""FSDP2 / torchtitan spellings of hsdp's API on a 2x2 gloo mesh, against a single-process
reference and FSDP2 (one spawned job; see fsdp2_api_jobs.py)."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks, same_on_every_rank
from fsdp2_api_jobs import fsdp2_api_job

TOL = 1e-5  # fp32, SGD with momentum
BF16_TOL = 2e-2

CASES = [("meshes",), ("mp_policy",), ("reshard",),
         ("deferred_outer", "set_requires_all_reduce"),
         ("deferred_outer", "set_is_last_backward"),
         ("forward_method", "hsdp"), ("forward_method", "hfsdp")]


@pytest.fixture(scope="module")
def results() -> dict:
    per_rank = run_ranks(fsdp2_api_job, 4, CASES)
    return {case: [r[case] for r in per_rank] for case in CASES}


def test_torchtitan_dim_names_and_one_dim_mesh(results):
    r = same_on_every_rank(results[("meshes",)])
    assert r["torchtitan"] < TOL and r["torchtitan_mesh"] == (2, 2), r
    assert r["one_dim"] < TOL and r["one_dim_mesh"] == (1, 4), r  # FSDP2: 1-D = shard


def test_torch_mixed_precision_policy(results):
    r = same_on_every_rank(results[("mp_policy",)])
    assert r["same"] == 0.0 and r["ref"] < BF16_TOL, r
    assert r["dtype"].startswith("TypeError: fully_shard: mp_policy") and \
        "hsdp.MixedPrecision(param_dtype=torch.bfloat16)" in r["dtype"], r


def test_reshard_options(results):
    r = same_on_every_rank(results[("reshard",)])
    assert r["ref"] < TOL, r
    assert r["int"].startswith("ValueError: hsdp: reshard_after_forward=2") and "use True" in \
        r["int"], r
    assert r["set_int"].startswith("ValueError: hsdp: reshard_after_forward=2"), r
    assert r["after_backward"].startswith("NotImplementedError: hsdp: set_reshard_after_"
                                          "backward(False)"), r
    assert r["after_backward_true"] == "", r


@pytest.mark.parametrize("method", ["set_requires_all_reduce", "set_is_last_backward"])
def test_outer_reduction_deferred_to_the_last_backward(results, method):
    r = same_on_every_rank(results[("deferred_outer", method)])
    assert r["ref"] < TOL and r["fsdp2"] < TOL, r
    assert r["outer_before_last"] == 0 and r["inner_before_last"] > 0, r
    assert "applies to the whole model" in r["not_root"], r


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_forward_method(results, strategy):
    r = same_on_every_rank(results[("forward_method", strategy)])
    assert r["unregistered"], r  # torch's registration is a no-op on hsdp modules
    assert r["ref"] < TOL and r["forward"] < TOL, r
    assert r["missing"].startswith("ValueError: hsdp.register_forward_method"), r
