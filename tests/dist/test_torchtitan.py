"""hsdp as torchtitan's data-parallel backend (``hsdp.integrations.torchtitan``): Llama3
``debugmodel`` on a 2x2 gloo mesh equals one process and torchtitan's FSDP2 path
(torchtitan_jobs.py). Needs the ``hsdp[torchtitan]`` extra (README: Using hsdp in torchtitan)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.train", reason="torchtitan is not installed: pip install "
                    "--no-deps per the hsdp[torchtitan] extra (README: Using hsdp in torchtitan)")

from dist_utils import run_ranks  # noqa: E402
from torchtitan_jobs import parity_job  # noqa: E402


def test_llama3_debugmodel_matches_one_process_and_fsdp2():
    per_rank = run_ranks(parity_job, 4)
    assert len(per_rank[0]) == 14
    bad = {k: e for r in per_rank for k, e in r.items() if not e < 1e-5}
    assert not bad, bad
