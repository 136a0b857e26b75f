"""FSDP2-style options on a 2x2 gloo mesh, each against a single-process reference (one
spawned job for every case; see drop_in_jobs.py)."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks, same_on_every_rank
from drop_in_jobs import drop_in_job

TOL = 1e-5  # fp32, SGD with momentum
BF16_TOL = 2e-2

CASES = [
    ("compile", "wrap_before"), ("compile", "method_after"),
    ("mixed_precision",),
    ("reshard_after_forward",),
    ("no_sync", "hsdp"), ("no_sync", "hfsdp"),
    ("unshard_prefetch",),
    ("freeze", "hsdp"), ("freeze", "hfsdp"),
    ("materialize", "hsdp"), ("materialize", "hfsdp"),
    ("accumulate", "hsdp", "none"), ("accumulate", "hfsdp", "zeros"),
    ("accumulate", "hsdp", "never"), ("accumulate", "hfsdp", "never"),
    ("full_tensor", "hsdp"), ("full_tensor", "hfsdp"),
]


@pytest.fixture(scope="module")
def results() -> dict:
    per_rank = run_ranks(drop_in_job, 4, CASES)
    return {case: [r[case] for r in per_rank] for case in CASES}


@pytest.mark.parametrize("mode", ["wrap_before", "method_after"])
def test_compiled_blocks_train_like_the_reference(results, mode):
    r = same_on_every_rank(results[("compile", mode)])
    assert r["ref"] < TOL and r["graph_breaks"] == 0 and r["graphs"] >= 1, r
    # Keys without "_orig_mod.": get_state_dict, save -> load into a plain model, and
    # load_full_state_dict of a plain model's state dict.
    assert r["keys"] < TOL, r


def test_input_casting_and_output_dtype(results):
    r = same_on_every_rank(results[("mixed_precision",)])
    assert r["dtypes_ok"], r
    assert r["ref"] < BF16_TOL and r["fsdp2"] < TOL, r


def test_reshard_after_forward_per_unit(results):
    r = same_on_every_rank(results[("reshard_after_forward",)])
    assert r["kept_ok"] and r["ref"] < TOL, r


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_microbatches_without_gradient_sync(results, strategy):
    r = same_on_every_rank(results[("no_sync", strategy)])
    assert r["comms_without_sync"] == 0 and r["ref"] < TOL, r


def test_explicit_unshard_and_prefetch(results):
    r = same_on_every_rank(results[("unshard_prefetch",)])
    assert r["ref"] < TOL and r["shown"] == 0.0 and r["resharded"], r


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_requires_grad_changes_after_sharding(results, strategy):
    r = same_on_every_rank(results[("freeze", strategy)])
    # A frozen parameter gets no update (weight decay included), is not counted by the
    # gradient norm, and a wholly frozen unit is not reduced at all.
    assert r["ref"] < TOL and r["norm"] < TOL and r["reduced_frozen"] == 0, r


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_meta_init_of_nested_units_then_training(results, strategy):
    r = same_on_every_rank(results[("materialize", strategy)])
    assert r["init"] == 0.0 and r["ref"] < TOL, r


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "accumulate"],
                         ids=lambda c: f"{c[1]}-{c[2]}")
def test_backward_twice_per_step_accumulates_like_torch(results, case):
    r = same_on_every_rank(results[case])
    assert r["ref"] < TOL, r


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_full_tensor_of_params_grads_and_optimizer_state(results, strategy):
    r = same_on_every_rank(results[("full_tensor", strategy)])
    assert max(r[k] for k in ("param", "grad", "momentum", "replicate")) < TOL, r
    assert r["torch_full"] == 0.0, r  # get_model_state_dict(full_state_dict=True)
    assert r["refused"] == [True, True], r
