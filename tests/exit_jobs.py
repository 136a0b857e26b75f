"""Worlds whose ranks end without ``destroy_process_group`` (``tests/dist/test_exit.py``).

Run as a script: ``python tests/exit_jobs.py LIBRARY RUNS WORLD`` runs ``RUNS`` worlds of
``WORLD`` gloo ranks one after another and prints one JSON line: each world's exit codes
(a negative code: the signal that ended the rank; None: it hung). Each rank is a child
forked from this process (torch and hsdp imported once) that trains one step on a
(2, WORLD/2) mesh (``hsdp``) or torch FSDP2 over the world (``fsdp2``) and then returns
from the script: the interpreter exits normally (``atexit``, finalization), as a training
script under torchrun does, which ``multiprocessing``'s children (``os._exit``) do not.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from dist_utils import free_port

import hsdp

HUNG_S = 120  # a world that has not ended by then is killed (its codes: None)


def _shard(library: str, model: nn.Sequential, world: int) -> None:
    if library == "hsdp":
        mesh = hsdp.init_mesh(2, world // 2, "cpu")
        for layer in model:
            hsdp.fully_shard(layer, mesh=mesh)
        hsdp.fully_shard(model, mesh=mesh)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def rank_job(library: str, rank: int, world: int, port: int) -> None:
    """One training step; no destroy_process_group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    _shard(library, model, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).square().mean().backward()
    opt.step()


def _world(library: str, world: int) -> list[int | None] | None:
    """Fork the ranks of one world; in a rank, run it and return None (the script then
    ends); in this process, the ranks' exit codes."""
    port = free_port()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            rank_job(library, rank, world, port)
            return None
        pids.append(pid)
    codes: dict[int, int | None] = dict.fromkeys(pids)
    deadline = time.monotonic() + HUNG_S
    while any(c is None for c in codes.values()) and time.monotonic() < deadline:
        for pid in [p for p, c in codes.items() if c is None]:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for pid in [p for p, c in codes.items() if c is None]:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return [codes[p] for p in pids]


def main(library: str, runs: int, world: int) -> bool:
    """True in this process once every world ended (the codes printed); False in a rank."""
    worlds = []
    for _ in range(runs):
        codes = _world(library, world)
        if codes is None:
            return False
        worlds.append(codes)
    print(json.dumps(worlds), flush=True)
    return True


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
