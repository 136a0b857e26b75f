"""advise's convergence costs come from the committed convergence runs."""

from __future__ import annotations

import json

import pytest

from hsdp_tools.advisor import MODES, convergence_cost


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
