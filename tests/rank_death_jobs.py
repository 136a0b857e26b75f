"""Jobs where one rank dies (``os._exit``) in the middle of hsdp's work: the survivors'
errors must name it (tests/dist/test_rank_death.py). The harness is ``run_ranks``'s
without the teardown a dead world cannot do: each rank writes its result and exits."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_jobs import Side, _build, _optimizer, _steps
from dist_utils import free_port

import hsdp

PG_TIMEOUT_S = 60


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    result = fn(rank, world, *args)
    with open(os.path.join(out, f"{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.rename(os.path.join(out, f"{rank}.pkl.tmp"), os.path.join(out, f"{rank}.pkl"))
    # Rank 0 serves the store, where later ranks' errors still look (torchrun's agent
    # would serve it): it stays until the others have their results, or a while.
    deadline = time.monotonic() + 2 * PG_TIMEOUT_S
    while (rank == 0 and sum(n.endswith(".pkl") for n in os.listdir(out)) < world - 1
           and time.monotonic() < deadline):
        time.sleep(0.2)
    os._exit(0)  # no teardown: its collectives would wait for the dead rank


def run_with_a_death(fn: Callable, world: int, *args: Any) -> dict[int, Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; the results of the ranks that
    lived, by rank."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_entry, args=(world, free_port(), fn, args, d),
                                 nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + 900
        while not all(p.exitcode is not None for p in ctx.processes):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} did not finish")
            time.sleep(1)
        out = {}
        for r in range(world):
            path = os.path.join(d, f"{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    out[r] = pickle.load(f)
        return out


def _error(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads the message (and its notes)
        return "\n".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", ())])
    return ""


def save_death_job(rank: int, world: int, root: str, dies: int) -> str:
    """Rank ``dies`` exits at the start of a save (after one that every rank finished)."""
    model = _build(Side(2, 2), 0)
    opt = _optimizer(model, "sgd")
    _steps(model, opt, range(1), rank, world)
    hsdp.save(os.path.join(root, "first"), model, opt)
    dist.barrier()
    if rank == dies:
        os._exit(0)
    time.sleep(2)  # the dead rank is gone
    return _error(lambda: hsdp.save(os.path.join(root, "second"), model, opt))



def tp_step_death_job(rank: int, world: int, dies: int) -> tuple[str, str]:
    """Rank ``dies`` exits at the start of a step of an HSDP + TP model (2 x 2 x 2).
    Returns what the liveness probe said while every rank lived, and the step's error."""
    from tp_jobs import TPCase, optimizer, sharded_model

    from hsdp.topology.liveness import gone_message

    model = sharded_model(hsdp.init_mesh(2, 2, "cpu", tp=2), TPCase())
    opt = optimizer(model)

    def step() -> None:
        model(torch.zeros(2, 8, dtype=torch.long)).square().mean().backward()
        opt.step()

    step()
    alive = gone_message()
    dist.barrier()
    if rank == dies:
        os._exit(0)
    return alive, _error(step)
