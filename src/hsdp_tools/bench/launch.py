"""Local ranks for the bench commands: in place under torchrun, else started here (CPU
ranks fork from a server that imported the command's module once; CUDA ranks are spawned).

Layouts on GPUs: one rank per GPU (NCCL's default), or, with ``--share-gpus``, several
ranks per GPU for correctness runs on fewer GPUs than ranks. NCCL refuses two ranks of one
communicator on one GPU, but the check is per communicator: rank (o, i) of an outer x
inner mesh goes on GPU (o + i) mod G, so that every inner group and every outer group
spans distinct GPUs when outer <= G and inner <= G. The default group is then
``cpu:gloo,cuda:nccl`` without a bound device (no NCCL communicator over the whole world)
and never runs a CUDA collective: barriers and bookkeeping go through gloo on CPU tensors
(``host_barrier``, ``bookkeeping_device``). Processes sharing a GPU time-slice it, so
such timings say nothing about speed.
"""

from __future__ import annotations

import argparse
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
# Recorded in the results: the above and NCCL settings that change what is measured.
RECORDED_ENV = (*NCCL_ENV, "NCCL_LAUNCH_ORDER_IMPLICIT", "NCCL_MAX_CTAS", "NCCL_MIN_CTAS",
                "CUDA_DEVICE_MAX_CONNECTIONS")


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


SHARED_LAYOUT_NOTE = "correctness layout (ranks share GPUs), timings not meaningful"


def add_layout_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--share-gpus", action="store_true",
                   help="several ranks per GPU: rank (o, i) on GPU (o + i) mod GPUs, for "
                        "correctness runs (e.g. a 2x2 mesh on 2 GPUs); timings are not "
                        "meaningful")


def shared_gpu(rank: int, inner: int, gpus: int) -> int:
    """The GPU of ``rank`` in the shared layout (module docstring)."""
    return (rank // inner + rank % inner) % gpus


def check_shared_layout(command: str, outer: int, inner: int, gpus: int) -> None:
    if outer > gpus or inner > gpus:
        raise SystemExit(f"hsdp {command}: --share-gpus needs outer and inner <= the "
                         f"number of GPUs ({gpus}) so that no communicator has two ranks "
                         f"on one GPU; got mesh {outer}x{inner}")


def launch(command: str, worker: Callable[[int, Any, int | None], None],
           resolve: Callable[[int], Any], nproc: int | None, cuda: bool,
           share_gpus: bool = False) -> int:
    """Run ``worker(local_rank, cfg, port)`` on every rank; ``cfg = resolve(world)``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ.get("LOCAL_RANK", 0)), resolve(int(os.environ["WORLD_SIZE"])),
               None)
        return 0
    gpus = torch.cuda.device_count()
    if nproc is None:
        nproc = (2 * gpus if share_gpus else gpus) if cuda else 4
    if cuda and not share_gpus and nproc > gpus:
        raise SystemExit(f"hsdp {command}: --nproc {nproc} but only {gpus} GPUs (NCCL needs "
                         f"one GPU per rank; --share-gpus places several ranks per GPU for "
                         f"correctness runs)")
    cfg = resolve(nproc)
    if cuda:  # a CUDA rank must not inherit a parent's CUDA state: a fresh interpreter
        method = "spawn"
    else:  # CPU ranks fork from one server that imported the worker's module once, not N
        method = "forkserver"
        mp.get_context(method).set_forkserver_preload([worker.__module__])
    try:
        mp.start_processes(worker, args=(cfg, free_port()), nprocs=nproc, join=True,
                           start_method=method)
    except mp.ProcessExitedException as e:  # its message went to stderr already
        print(f"hsdp {command}: rank {e.error_index} exited with code {e.exit_code}",
              file=sys.stderr)
        return e.exit_code or 1
    return 0


@contextmanager
def rank_process_group(local_rank: int, world: int, port: int | None, cuda: bool,
                       shared_inner: int | None = None) -> Iterator[torch.device]:
    """This rank's device with the default process group around it. ``port`` is set when
    spawned (rank = local rank), None under torchrun. ``shared_inner``: the mesh's inner
    size in the shared-GPU layout (module docstring)."""
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RANK=str(local_rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(local_rank))
    if cuda and shared_inner is not None:
        gpu = shared_gpu(int(os.environ["RANK"]), shared_inner, torch.cuda.device_count())
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl")  # no device_id: no world communicator
    elif cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo")
    try:
        yield device
    finally:
        dist.destroy_process_group()


def bookkeeping_device(device: torch.device) -> torch.device:
    """Where tensors for the default group's own collectives live: CPU whenever it has
    gloo (CPU runs, the shared-GPU layout), else ``device``."""
    return torch.device("cpu") if "gloo" in str(dist.get_backend()) else device


def host_barrier() -> None:
    """A barrier on the default group that never runs a CUDA collective there."""
    if "gloo" in str(dist.get_backend()):
        dist.all_reduce(torch.zeros(1))
    else:
        dist.barrier()
