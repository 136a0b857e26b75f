"""Real NCCL on the GPUs of one host (skipped on fewer GPUs than a test needs).

Two GPUs: the 2x2 parity matrix with two ranks per GPU (the shared layout of
``hsdp_tools.bench.launch``: rank (o, i) on GPU (o + i) mod 2, so every communicator spans two
distinct GPUs; the default group never runs a CUDA collective), 1x2 and 2x1 with one rank
per GPU, the schedule seen in real-NCCL profiler traces on the 2x2 mesh, and a soak test.
Four GPUs: the parity matrix with one rank per GPU and the traces on 2x2 without sharing.
Failures (two GPUs): a rank killed mid-step makes the other raise within the timeout.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
from dist_utils import run_ranks
from parity_jobs import Case, lagging_outer_job, parity_job
from reduction_jobs import reductions_job
from soak_job import soak_job

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on shared hosts
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def needs(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs")


def matrix(meshes: list[tuple[int, int]]) -> list[Case]:
    return [Case(o, i, strategy, overlap, mb, ac, device="cuda")
            for (o, i), strategy, overlap, mb, ac in itertools.product(
                meshes, ["hsdp", "hfsdp"], [True, False], [1, 3], ["none", "reentrant"])]


FSDP2_2X2 = [Case(2, 2, "hsdp", True, mb, fsdp2=True, device="cuda") for mb in (1, 3)]
# fp32 matmuls on GPU run other kernels for other batch shapes than the reference's.
TOL = 1e-4


def check_parity(results: list[dict], cases: list[Case]) -> None:
    for case in cases:
        e = results[0][case]
        assert all(r[case] == e for r in results), case
        assert all(v < TOL for v in e.values()), (case, e)


@needs(2)
@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_reductions_on_nccl_2x2_two_ranks_per_gpu(strategy: str) -> None:
    per_rank = run_ranks(reductions_job, 4, strategy, "cuda", backend="nccl", shared_inner=2)
    assert all(r == per_rank[0] for r in per_rank), per_rank
    assert all(per_rank[0].values()), sorted(k for k, ok in per_rank[0].items() if not ok)


@needs(2)
def test_parity_2x2_two_ranks_per_gpu() -> None:
    cases = matrix([(2, 2)]) + FSDP2_2X2
    check_parity(run_ranks(parity_job, 4, cases, backend="nccl", shared_inner=2), cases)


@needs(2)
def test_parity_1x2_and_2x1_one_rank_per_gpu() -> None:
    cases = matrix([(1, 2), (2, 1)])
    check_parity(run_ranks(parity_job, 2, cases, backend="nccl"), cases)


@needs(2)
def test_parity_bf16_reduction_with_a_lagging_outer_stream() -> None:
    """The reduce-scatter's bf16 result goes to the outer all-reduce on another stream
    (``SideStream.hold``): overlapped and serialized schedules train the same bits."""
    assert all(r["equal"] for r in run_ranks(lagging_outer_job, 2, backend="nccl"))


@needs(4)
def test_parity_on_nccl() -> None:
    cases = matrix([(1, 4), (2, 2), (4, 1)]) + FSDP2_2X2
    check_parity(run_ranks(parity_job, 4, cases, backend="nccl"), cases)


def _trace_job(rank: int, world: int, strategy: str) -> dict:
    import cuda_child

    import hsdp
    return cuda_child.trace(strategy, hsdp.init_mesh(2, world // 2, "cuda"))


def check_trace(r: dict) -> None:
    print(r)
    assert r["rs_streams"] == ["rs"] and r["outer_streams"] == ["outer"]
    assert r["n_outer"] == r["n_rs"] > 2
    assert r["outer_overlapping_next_rs"] >= 1, r
    assert r["rs_waits_on_outer"] == 0, r
    assert r["compute_waits_on_outer_before_last_outer_issue"] == 0, r


@needs(2)
@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_real_nccl_outer_overlaps_previous_rs_two_ranks_per_gpu(strategy: str) -> None:
    check_trace(run_ranks(_trace_job, 4, strategy, backend="nccl", shared_inner=2)[0])


@needs(4)
@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_real_nccl_outer_overlaps_previous_rs(strategy: str) -> None:
    check_trace(run_ranks(_trace_job, 4, strategy, backend="nccl")[0])


SOAK_STEPS = 200


@needs(2)
def test_soak_random_delays_no_hang_bit_identical() -> None:
    results = run_ranks(soak_job, 4, 2, SOAK_STEPS, "cuda", backend="nccl", shared_inner=2,
                        timeout=540)
    for key in results[0]:
        assert all(r[key]["identical"] for r in results), (key, results)
        assert all(r[key]["delays"] > 0 for r in results), (key, results)


# --------------------------------------------------------------------------- failures

KILL_TIMEOUT_S = 30.0


class _Die(torch.autograd.Function):
    """Identity whose backward kills the process (SIGKILL: no cleanup, like a lost node)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGKILL)
        return grad


def _killed_rank_entry(rank: int, world: int, port: int, out_dir: str) -> None:
    """1x2 mesh, one rank per GPU. Rank 1 dies in the middle of the second step's backward
    (after two units' reduce-scatters). Rank 0 writes what it raised and when, then leaves
    without teardown: its NCCL kernels still wait for the dead peer."""
    import torch.distributed as dist
    import torch.nn as nn

    import hsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world,
                            timeout=timedelta(seconds=KILL_TIMEOUT_S))
    mesh = hsdp.init_mesh(1, world, "cuda")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4))).cuda()
    for layer in model:
        hsdp.fully_shard(layer, mesh=mesh)
    hsdp.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 256, device="cuda")
    result: dict = {}
    for step in range(3):
        if step == 1 and rank == 1:
            model[1].register_forward_hook(lambda m, args, out: _Die.apply(out))
            with open(os.path.join(out_dir, "killed"), "w") as f:
                f.write(repr(time.time()))  # (the backward runs within milliseconds)
        t0 = time.time()
        try:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hsdp.synchronize(model)
        except Exception as exc:  # what the user's training loop would see
            result = {"error": f"{type(exc).__name__}: {exc}", "step": step,
                      "raised_at": time.time(), "step_start": t0}
            break
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


@needs(2)
def test_killed_rank_makes_the_other_raise_within_the_timeout(tmp_path) -> None:
    """Issue 9's GPU acceptance: real NCCL, a rank killed mid-step. The survivor raises
    hsdp's error at the end-of-step agreement (its gloo group sees the peer gone), unless
    NCCL's watchdog notices first and ends it with its own error; either well within the
    timeout, never a hang."""
    import torch.multiprocessing as mp
    from dist_utils import free_port

    ctx = mp.start_processes(_killed_rank_entry, args=(2, free_port(), str(tmp_path)),
                             nprocs=2, join=False, start_method="spawn")
    survivor = ctx.processes[0]
    deadline = time.monotonic() + 300 + KILL_TIMEOUT_S
    while survivor.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = time.time()
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    killed = float((tmp_path / "killed").read_text())
    report = tmp_path / "0.json"
    result = json.loads(report.read_text()) if report.exists() else {}
    print(f"survivor exit code {survivor.exitcode}, ended {ended - killed:.1f} s after the "
          f"kill; {result}")
    assert ended - killed < KILL_TIMEOUT_S, "the survivor hung past the timeout"
    if result:  # hsdp's error, in the step where the peer died
        assert result["step"] == 1 and result["error"].startswith("RuntimeError: hsdp:"), result
    else:  # NCCL noticed first: its watchdog ended the process with an error
        assert survivor.exitcode != 0, survivor.exitcode
