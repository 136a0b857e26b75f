"""Local ranks for the bench commands: in place under torchrun, else spawned here."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast off: on shared hosts a program using it can take the GPUs down.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def select_cuda(device: str, command: str) -> bool:
    """Apply NCCL_ENV (unless set) and resolve ``--device auto|cpu|cuda``."""
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"hsdp {command}: --device cuda but no GPU is visible")
    return cuda


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: str, worker: Callable[[int, Any, int | None], None],
           resolve: Callable[[int], Any], nproc: int | None, cuda: bool) -> int:
    """Run ``worker(local_rank, cfg, port)`` on every rank; ``cfg = resolve(world)``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ.get("LOCAL_RANK", 0)), resolve(int(os.environ["WORLD_SIZE"])),
               None)
        return 0
    if nproc is None:
        nproc = torch.cuda.device_count() if cuda else 4
    if cuda and nproc > torch.cuda.device_count():
        raise SystemExit(f"hsdp {command}: --nproc {nproc} but only "
                         f"{torch.cuda.device_count()} GPUs (NCCL needs one GPU per rank)")
    cfg = resolve(nproc)
    try:
        mp.spawn(worker, args=(cfg, free_port()), nprocs=nproc, join=True)
    except mp.ProcessExitedException as e:  # its message went to stderr already
        print(f"hsdp {command}: rank {e.error_index} exited with code {e.exit_code}",
              file=sys.stderr)
        return e.exit_code or 1
    return 0


@contextmanager
def rank_process_group(local_rank: int, world: int, port: int | None,
                       cuda: bool) -> Iterator[torch.device]:
    """This rank's device with the default process group around it. ``port`` is set when
    spawned (rank = local rank), None under torchrun."""
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RANK=str(local_rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(local_rank))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        if "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo")
    try:
        yield device
    finally:
        dist.destroy_process_group()
