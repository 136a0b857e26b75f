"""hfsdp's compressed outer parameter all-gather (``outer_gather``) on 4 CPU ranks (2x2,
gloo) and 8 (2x4): the gathered weights are the quantized exact chunks bit for bit and the
same on every rank, the exact main weights are what the optimizer steps and what
checkpoints hold, the outer bytes halve, bad input is refused on every rank."""

from __future__ import annotations

import pytest
from dist_utils import run_jobs, same_on_every_rank
from outer_gather_jobs import (
    bytes_job,
    checkpoint_job,
    errors_job,
    parity_job,
    same_grads_job,
)

from hsdp_tools.bench.convergence import Plan, convergence_job, final_losses

CONVERGENCE = Plan(((2, 4, "hfsdp"),), (0,), ("exact", "int8 gather"), steps=25)
TRUE = {"first_forward": True, "bit_exact": True, "replicas_identical": True,
        "quantized": True, "main_apart": True, "finite": True}
SAME_GRADS = {"main_equal": True, "state_dict_equal": True, "stepped": True,
              "replicas_differ": True, "compressed_bit_exact": True}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, list]:
    return run_jobs(4, {"parity": (parity_job, (2,)), "same_grads": (same_grads_job, (2,)),
                        "checkpoint": (checkpoint_job, (str(tmp_path_factory.mktemp("qg")),)),
                        "bytes": (bytes_job, ()), "errors": (errors_job, ())})


@pytest.fixture(scope="module")
def jobs8() -> dict[str, list]:
    return run_jobs(8, {"parity": (parity_job, (2, ("int8-bf16", "fp8"))),
                        "same_grads": (same_grads_job, (2,)),
                        "convergence": (convergence_job, (CONVERGENCE,))})


@pytest.mark.parametrize("case", ["int8", "int8-bf16", "fp8", "int8-bf16+reduce"])
def test_gathered_weights_are_the_quantized_exact_chunks_on_every_rank(case, jobs) -> None:
    """2x2: after two steps every group's inner shard is the written-out quantization of
    every outer rank's exact chunk (its own too), bit for bit, and every rank of the world
    holds the same gathered weights; with the compressed reduction too."""
    assert same_on_every_rank([x[case] for x in jobs["parity"]]) == TRUE


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_main_weights_stay_exact(dtype, jobs) -> None:
    """The same gradients give the same exact main weights as the uncompressed gather (fp32
    parameters too, where the exact gather's main is a window of the inner shard)."""
    assert same_on_every_rank([x[dtype] for x in jobs["same_grads"]]) == SAME_GRADS


@pytest.mark.full
def test_a_2x4_mesh(jobs8) -> None:
    """The same on 8 ranks (2 outer x 4 inner)."""
    for case in ("int8-bf16", "fp8"):
        assert same_on_every_rank([x[case] for x in jobs8["parity"]]) == TRUE, case
    for dtype in ("fp32", "bf16"):
        assert same_on_every_rank([x[dtype] for x in jobs8["same_grads"]]) == SAME_GRADS


@pytest.mark.full
def test_a_short_run_converges_like_exact(jobs8) -> None:
    """25 AdamW steps of the convergence bench's Llama on 2x4: it learns, the int8 gather
    changed the losses, and the final loss is within 0.02 of the exact gather's (the
    500-step, 3-seed runs: docs/benchmarks.md)."""
    curves = jobs8["convergence"][0]
    exact, int8 = (curves[f"2x4 hfsdp/seed0/{run}"] for run in CONVERGENCE.runs)
    assert exact[0] - exact[-1] > 1.0, exact
    assert int8 != exact
    finals = final_losses(curves, tail=5)
    assert abs(finals[("2x4 hfsdp", "int8 gather")][0]
               - finals[("2x4 hfsdp", "exact")][0]) < 0.02, finals


def test_checkpoints_hold_the_exact_main_weights(jobs) -> None:
    r = same_on_every_rank(jobs["checkpoint"])
    assert r == {"saved_exact_main": True, "replicas_not_saved": True, "resumed_equal": True,
                 "full_load_quantized": True}


def test_outer_gather_bytes_halve(jobs) -> None:
    """bf16 weights: the outer all-gather moves one byte per weight plus a 4-byte scale per
    block of 16 (1.25 bytes) instead of two; the reduce-scatter is unchanged."""
    r = same_on_every_rank(jobs["bytes"])
    exact, int8 = r["exact"], r["int8"]
    assert int8["reduce_scatter"] == exact["reduce_scatter"]
    assert int8["all_gather"] / exact["all_gather"] == pytest.approx(1.25 / 2, rel=0.05)


def test_bad_outer_gather_is_refused_on_every_rank(jobs) -> None:
    r = same_on_every_rank(jobs["errors"])
    assert r["hsdp"].startswith("ValueError: fully_shard: outer_gather needs strategy='hfsdp'")
    assert r["dtype"].startswith("ValueError: hsdp.OuterGather: unknown dtype 'int4'")
    assert r["block"].startswith("ValueError: hsdp.OuterGather: block=100 does not divide")
    assert r["block0"].startswith("ValueError: hsdp.OuterGather: block=0 does not divide")
    assert r["short"].startswith("ValueError: hsdp.OuterGather: block=12 does not divide")
    assert r["type"].startswith("TypeError: fully_shard: outer_gather must be")
    assert r["float8"].startswith("ValueError: fully_shard: outer_gather on a unit with "
                                  "float8 weights")
    assert all(v.endswith("(unchanged: True)") for v in r.values()), r
