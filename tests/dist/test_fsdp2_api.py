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
         ("forward_method", "hsdp"), ("forward_method", "hfsdp"), ("all_reduce_hook",),
         ("refusals",)]


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
    # torch's register_fsdp_forward_method trains as FSDP2's and the reference
    assert r["ref"] < TOL and r["fsdp2"] < TOL and r["forward"] < TOL, r
    assert r["sharded_after"], r  # resharded after each call, as after forward
    # torch's function taken before hsdp sharded a module does nothing on hsdp modules:
    # the errors name hsdp's
    for key in ("unregistered", "project", "outside"):
        assert "hsdp.register_forward_method(module, 'name')" in r[key], (key, r)
    assert "mixed torch.Tensor and DTensor" in r["project"], r
    assert "outside the forward of the model" in r["outside"], r
    assert r["missing"].startswith("ValueError: hsdp.register_forward_method"), r


def test_all_reduce_hook_as_fsdp2(results):
    r = same_on_every_rank(results[("all_reduce_hook",)])
    for mesh in ("2x2", "one_dim"):
        assert r[f"{mesh}/fsdp2"] < TOL and r[f"{mesh}/ref"] > 1e-3, r
        assert r[f"{mesh}/calls"] == (4 * 3, 4 * 3), r  # (3 blocks + root) x 3 steps
        assert r[f"{mesh}/threads"] == ["hsdp-outer"], r
    assert r["hfsdp"].startswith("ValueError: hsdp: set_all_reduce_hook needs strategy="), r
    assert r["stream"].startswith("NotImplementedError: hsdp: set_all_reduce_hook(stream="), r


def test_cpu_offload_and_save_pretrained_refused_naming_what_to_use(results):
    per_rank = [dict(r) for r in results[("refusals",)]]
    architectures = [r.pop("architectures") for r in per_rank]  # rank 0 saved
    r = same_on_every_rank(per_rank)
    assert r["cpu_offload"].startswith("NotImplementedError: fully_shard: offload_policy="
                                       "CPUOffloadPolicy(...) is not supported"), r
    assert r["no_offload"] == "", r
    if r["saved"]:  # transformers is installed
        assert "hsdp.full_state_dict(model, rank0_only=True)" in r["save_pretrained"], r
        assert "save_pretrained(path, state_dict=full)" in r["save_pretrained"], r
        assert r["saved"] == "True", r
        # config.json names the model's own class (transformers strips only "FSDP")
        assert architectures[0] == ["LlamaForCausalLM"], architectures
        assert r["class_after"] == "HSDPLlamaForCausalLM", r
