"""Float8 training with torchao's float8 linears under hsdp (CPU, gloo 2x2, emulated
float8): parameters after 5 steps equal one process's torchao float8 training and FSDP2 +
torchao's on the same mesh, with torchao's float8 all-gather off and on, both strategies,
microbatches, activation checkpointing, compiled blocks and bf16 compute (against FSDP2
only); with it on, hsdp's all-gathers move one byte per float8 weight element, and a
gather with scales older than the weights is refused until
``hsdp.precompute_float8_scales``. One spawned job runs the cases in which every setting's
every value occurs (tests/case_cover.py) and those the byte and meta checks compare; the
full tier runs the others in a second job."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("torchao")

from case_cover import cover_split  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from float8_jobs import STEPS, Case, float8_job  # noqa: E402

TOL = 1e-5  # fp32 master weights, SGD with momentum, 5 steps
COMPRESSED_TOL = 1e-2  # with the int8 outer reduction (block 16)
INNER = 2

CASES = [
    Case(strategy, all_gather, mb)
    for strategy, all_gather, mb in itertools.product(("hsdp", "hfsdp"), (False, True), (1, 3))
] + [Case(strategy, all_gather, 1, "non_reentrant")
     for strategy, all_gather in itertools.product(("hsdp", "hfsdp"), (False, True))
] + [Case(strategy, True, mb, compile=True, edit=True)
     for strategy, mb in (("hsdp", 1), ("hfsdp", 3))
] + [Case(strategy, True, bf16=True) for strategy in ("hsdp", "hfsdp")
] + [Case(strategy, True, meta=True) for strategy in ("hsdp", "hfsdp")
] + [Case(strategy, False, mb, recipe="rowwise")
     for strategy, mb in (("hsdp", 3), ("hfsdp", 1))
] + [Case(strategy, True, mb, outer_reduce="int8") for strategy, mb in (("hsdp", 1), ("hfsdp", 3))]


# (strategy, microbatches) whose all-gather bytes the default tier compares (off and on)
BYTES = [("hsdp", 1), ("hfsdp", 3)]
BYTES_REST = [("hsdp", 3), ("hfsdp", 1)]


def _bytes_cases(pairs: list[tuple[str, int]]) -> list[Case]:
    return [Case(s, on, mb) for s, mb in pairs for on in (False, True)]


COVER, REST = cover_split(CASES, keep=_bytes_cases(BYTES) + [
    Case(s, on, meta=meta) for s in ("hsdp", "hfsdp") for on, meta in ((True, False),
                                                                       (True, True))],
    strength=1)


def _results(request: pytest.FixtureRequest, case: Case) -> dict:
    """The results of the world that ran ``case``: the default tier's or the full tier's."""
    return request.getfixturevalue("results" if case in COVER else "results_rest")


def _run(cases: list[Case]) -> dict:
    per_rank = run_ranks(float8_job, 4, cases)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the full state dict"
    return per_rank[0]


@pytest.fixture(scope="module")
def results() -> dict:
    return _run(COVER)


@pytest.fixture(scope="module")
def results_rest() -> dict:
    return _run(REST + [c for c in _bytes_cases(BYTES_REST) if c not in REST])


@pytest.mark.parametrize("case", COVER, ids=str)
def test_float8_parity_with_one_process_and_fsdp2(case: Case, results: dict) -> None:
    _check_parity(results[case], case)


@pytest.mark.full
@pytest.mark.parametrize("case", REST, ids=str)
def test_float8_parity_rest(case: Case, results_rest: dict) -> None:
    _check_parity(results_rest[case], case)


def _check_parity(r: dict, case: Case) -> None:
    tol = COMPRESSED_TOL if case.outer_reduce else TOL
    if not case.bf16:  # one process computes in fp32 only
        assert r["fsdp2_vs_ref"] < TOL, r  # the references agree
        assert r["ref"] < tol, r
    assert r["fsdp2"] < tol, r
    if case.outer_reduce:  # it compressed
        assert r["ref"] > 10 * TOL, r


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_float8_after_materialize_gathers_float8(strategy: str, results: dict) -> None:
    """Built on the meta device and initialized by hsdp.materialize: still gathered in
    float8 (its scales computed from the initialized weights), with the same bytes."""
    meta, built = results[Case(strategy, True, meta=True)], results[Case(strategy, True)]
    assert meta["all_gather_bytes"] == built["all_gather_bytes"], (meta, built)


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[] if c in COVER else [pytest.mark.full]) for c in CASES if c.edit],
    ids=str)
def test_float8_gather_with_stale_scales_is_refused(case: Case, request) -> None:
    """Weights scaled by hand after a step: the next forward raises (naming the call to
    make) instead of casting with the old scales; after hsdp.precompute_float8_scales
    training goes on equal to one process (checked above)."""
    assert "hsdp.precompute_float8_scales(model)" in _results(request, case)[case]["refused"]


@pytest.mark.parametrize("strategy,mb", BYTES + [
    pytest.param(*p, marks=pytest.mark.full) for p in BYTES_REST])
def test_float8_all_gather_moves_one_byte_per_weight_element(strategy: str, mb: int,
                                                             request) -> None:
    """Each float8 weight element costs 1 byte instead of fp32's 4 in every inner
    all-gather (2 units x (forward + backward) per microbatch) and, for hfsdp, in the outer
    all-gather after each step (this rank's inner shard: 1/INNER of the weights)."""
    off, on = (_results(request, c)[c] for c in (Case(strategy, False, mb),
                                                  Case(strategy, True, mb)))
    f8 = on["float8_numel"]
    saved = {axis: off["all_gather_bytes"][axis] - on["all_gather_bytes"][axis]
             for axis in ("inner", "outer")}
    assert saved["inner"] == 3 * f8 * 2 * mb * STEPS, (off, on)
    assert saved["outer"] == (3 * f8 // INNER * STEPS if strategy == "hfsdp" else 0), (off, on)
