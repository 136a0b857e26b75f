"""Real NCCL on several GPUs of one host (skipped with fewer than 4): the parity matrix on
CUDA, and the schedule seen in a profiler trace with real collectives. Not yet run: no
multi-GPU machine was available when this was written (issue 4)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from dist_utils import run_ranks
from parity_jobs import Case, parity_job

WORLD = 4
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
    reason=f"needs {WORLD} GPUs")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on shared hosts
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

CASES = [
    Case(o, i, strategy, overlap, mb, ac, device="cuda")
    for (o, i), strategy, overlap, mb, ac in itertools.product(
        [(1, 4), (2, 2), (4, 1)], ["hsdp", "hfsdp"], [True, False], [1, 3],
        ["none", "reentrant"])
] + [Case(2, 2, "hsdp", True, mb, fsdp2=True, device="cuda") for mb in (1, 3)]
# fp32 matmuls on GPU run other kernels for other batch shapes than the reference's.
TOL = 1e-4


def test_parity_on_nccl() -> None:
    results = run_ranks(parity_job, WORLD, CASES, backend="nccl")
    for case in CASES:
        e = results[0][case]
        assert all(r[case] == e for r in results), case
        assert all(v < TOL for v in e.values()), (case, e)


def _trace_job(rank: int, world: int, strategy: str) -> dict:
    import cuda_child

    import hsdp
    return cuda_child.trace(strategy, hsdp.init_mesh(2, world // 2, "cuda"))


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_real_nccl_outer_overlaps_previous_rs(strategy: str) -> None:
    r = run_ranks(_trace_job, WORLD, strategy, backend="nccl")[0]
    print(r)
    assert r["rs_streams"] == ["rs"] and r["outer_streams"] == ["outer"]
    assert r["outer_overlapping_next_rs"] >= 1, r
    assert r["rs_waits_on_outer"] == 0, r
    assert r["compute_waits_on_outer_before_last_outer_issue"] == 0, r
