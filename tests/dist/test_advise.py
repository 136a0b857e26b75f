"""``hsdp_tools.advise`` in a running job: the links measured on the job's communicators,
every mode priced, one choice on every rank (4 gloo ranks; the long tier: the simulator
runs once per mode)."""

from __future__ import annotations

import pytest
from advise_jobs import advise_job
from dist_utils import run_ranks, same_on_every_rank


@pytest.mark.full
def test_advise_measures_prices_and_agrees() -> None:
    results = run_ranks(advise_job, 4)
    report = same_on_every_rank([r["report"] for r in results])
    modes = {r["mode"]: r for r in report["modes"]}
    assert list(modes) == ["exact", "int8", "diloco H10", "diloco H50"], modes
    assert all(li["bus_gbps"] > 0 for li in report["links"].values()), report["links"]
    fastest = min(r["t_step_ms"] for r in modes.values())
    assert modes[report["choice"]]["t_step_ms"] <= fastest * 1.02, report
    assert all(r["t_step_ms"] >= report["t_free_ms"] for r in modes.values()), report
    # fewer outer bytes: int8 below exact, DiLoCo by its period
    b = {k: r["outer_bytes_per_step"] for k, r in modes.items()}
    assert b["exact"] > b["int8"] > b["diloco H10"] > b["diloco H50"] > 0, b
    assert modes["int8"]["convergence"]["source"].startswith("docs/results/cpu/"), modes

    # hsdp_tools.auto: DiLoCo on a very slow outer link, exact on a very fast one, the
    # same on every rank, logged once (rank 0) with the priced numbers
    for rank, r in enumerate(results):
        assert r["slow"]["outer_sync"].startswith("DiLoCo(inner_steps="), (rank, r["slow"])
        assert r["fast"]["outer_sync"] == "None" == r["fast"]["outer_reduce"], (rank, r)
        for name in ("slow", "fast"):
            assert len(r[name]["logged"]) == (rank == 0), (rank, r[name])
        if rank == 0:
            assert "0.00 GB/s" in r["slow"]["logged"][0], r["slow"]
            assert "chose diloco" in r["slow"]["logged"][0], r["slow"]
