"""Spawn a multi-rank job (gloo on CPU, or NCCL on GPUs) and collect each rank's result."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hsdp_tools.bench.launch import host_barrier, shared_gpu

# gloo worlds start from a fork server that has imported torch, hsdp and the ecosystem
# packages once: a spawned rank spends ~2.5 s of CPU importing them (5 s with torchtitan),
# 40-80 s of a 2-core machine per 8-rank world. A module missing here is skipped.
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor",
            "torch.distributed.checkpoint", "torch.distributed.pipelining", "hsdp",
            "torchft", "torchtitan.models.llama3", "torchtitan.models.deepseek_v3",
            "torchtitan.components.checkpoint"]
mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _take_environ(environ: dict[str, str]) -> None:
    """A forked process inherits the fork server's environment: take the test's own; one
    thread (the ranks share the cores)."""
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str,
           backend: str, shared_inner: int | None, pg_timeout_s: float | None,
           environ: dict[str, str]) -> None:
    _take_environ(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if backend == "nccl" and shared_inner is not None:
        # Several ranks per GPU (hsdp_tools.bench.launch): no communicator over the whole world.
        torch.cuda.set_device(shared_gpu(rank, shared_inner, torch.cuda.device_count()))
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    elif backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        timeout = {} if pg_timeout_s is None else {"timeout": timedelta(seconds=pg_timeout_s)}
        dist.init_process_group(backend, rank=rank, world_size=world, **timeout)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        host_barrier()
    finally:
        dist.destroy_process_group()


def _logged_main(main: Callable[[dict], None], cfg: dict, log: str,
                 environ: dict[str, str]) -> None:
    _take_environ(environ)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    main(cfg)


class Forked:
    """``main(cfg)`` in a process of the preloaded fork server, its output in ``log``; a
    ``subprocess.Popen``'s ``wait``, ``poll``, ``returncode`` and ``kill`` (-9 once
    SIGKILLed). For jobs that are one rank of a world of their own (torchft replica
    groups): no import of their own to pay."""

    def __init__(self, main: Callable[[dict], None], cfg: dict, log: str) -> None:
        self._proc = mp.get_context("forkserver").Process(
            target=_logged_main, args=(main, cfg, log, dict(os.environ)))
        self._proc.start()

    def wait(self, timeout: float) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank of {self._proc.name}", timeout)
        return self._proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()


TIMEOUT_S = 900


def run_ranks(fn: Callable, world: int, *args: Any, backend: str = "gloo",
              shared_inner: int | None = None, timeout: float = TIMEOUT_S,
              pg_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks (gloo on CPU, or nccl with one
    GPU each; with ``shared_inner``, the inner size of the job's mesh, nccl ranks share
    GPUs as ``hsdp_tools.bench.launch`` places them); returns their results. A job that hangs
    (a schedule deadlock) fails after ``timeout`` seconds instead of blocking CI.
    ``pg_timeout_s``: the default process group's timeout (gloo)."""
    with tempfile.TemporaryDirectory() as d:
        # CUDA ranks are spawned: nothing CUDA-related is inherited from a fork server.
        method = "spawn" if backend == "nccl" else "forkserver"
        ctx = mp.start_processes(_entry, args=(world, free_port(), fn, args, d, backend,
                                               shared_inner, pg_timeout_s, dict(os.environ)),
                                 nprocs=world, join=False, start_method=method)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in "
                                   f"{timeout} s")
        results = []
        for r in range(world):
            with open(os.path.join(d, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


Job = tuple[Callable, tuple]


def _jobs_in_sequence(rank: int, world: int, jobs: dict[str, Job]) -> dict[str, Any]:
    return {name: fn(rank, world, *args) for name, (fn, args) in jobs.items()}


def run_jobs(world: int, jobs: dict[str, Job], **kwargs: Any) -> dict[str, list[Any]]:
    """Run several jobs ``name: (fn, args)`` one after another in ONE spawned world of
    ``world`` ranks (start-up dominates on two cores); returns each job's per-rank results,
    as ``run_ranks`` would, by name. ``kwargs``: ``run_ranks``'s options."""
    per_rank = run_ranks(_jobs_in_sequence, world, jobs, **kwargs)
    return {name: [r[name] for r in per_rank] for name in jobs}


def same_on_every_rank(per_rank: list[Any]) -> Any:
    """The one result every rank returned (asserted: no rank-divergent outcome)."""
    assert all(r == per_rank[0] for r in per_rank), per_rank
    return per_rank[0]
