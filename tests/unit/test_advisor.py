"""advise's convergence costs come from the committed convergence runs."""

from __future__ import annotations

import json

import pytest

from hsdp_tools.advisor import MODES, choose, convergence_cost


def test_convergence_cost_reads_the_cited_runs(tmp_path) -> None:
    (tmp_path / "cpu").mkdir()
    curves = {"m/seed0/exact": [3.0] * 10 + [2.0] * 10, "m/seed1/exact": [2.2] * 20,
              "m/seed0/int8+EF": [2.1] * 20, "m/seed1/int8+EF": [2.3] * 20}
    (tmp_path / "cpu" / "r.json").write_text(json.dumps({"curves": curves}))
    got = convergence_cost(("r.json", "int8+EF"), tmp_path)
    assert got["pct"] == pytest.approx(100 * (2.2 / 2.1 - 1))
    assert got["spread_pct"] == pytest.approx(100 * 0.2 / 2.1)
    with pytest.raises(ValueError, match="no run"):
        convergence_cost(("r.json", "fp8"), tmp_path)


def test_every_committed_run_is_found() -> None:
    for m in MODES:
        for f in (1, 4):
            run = None if m.run is None else (m.run[0], m.run[1].format(f=f))
            assert convergence_cost(run)["source"]


def test_choice_counts_no_loss_cost_within_the_exact_seed_spread() -> None:
    """Modes as fast as each other: a loss difference inside the exact runs' spread over
    seeds tells nothing, so the least departure from exact wins (it once chose DiLoCo H50
    on a fast link for its -0.08 % within a 2.3 % spread)."""
    def row(mode: str, ms: float, pct: float) -> dict:
        return {"mode": mode, "t_step_ms": ms, "convergence": {"pct": pct, "spread_pct": 2.3}}

    tied = [row("exact", 155.7, 0.0), row("int8", 193.4, 0.0), row("diloco H10", 156.8, 0.23),
            row("diloco H50", 155.1, -0.08)]
    assert choose(tied) == "exact"
    costly = [row("exact", 155.7, 0.0), row("diloco H50", 155.1, 0.0),
              row("diloco H10", 100.0, 5.0), row("int8", 101.0, 0.5)]
    assert choose(costly) == "int8"  # as fast as H10 (within 2 %), no cost beyond spread
    assert choose([row("exact", 300.0, 0.0), row("diloco H50", 100.0, 5.0)]) == "diloco H50"
