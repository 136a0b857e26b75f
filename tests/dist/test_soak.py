"""Soak on CPU (gloo, 2x2): steps with random per-rank delays before the collectives of
different streams finish (no hang) with parameters bit-identical to the same steps without
delays, for hsdp and hfsdp, overlapped and serialized (tests/soak_job.py; the 200-step
run on GPUs is in tests/gpu/test_multi_gpu.py)."""

from dist_utils import run_ranks
from soak_job import soak_job

STEPS = 12


def test_soak_random_delays_no_hang_bit_identical():
    results = run_ranks(soak_job, 4, 2, STEPS, "cpu", timeout=300)
    assert set(results[0]) == {"hsdp/overlap", "hsdp/serial", "hfsdp/overlap",
                               "hfsdp/serial"}
    for key in results[0]:
        assert all(r[key]["identical"] for r in results), (key, results)
        assert all(r[key]["delays"] > 0 for r in results), (key, results)
