"""Job bodies of ``test_agreement_world.py`` (spawned by ``dist_utils.run_ranks``): ranks
that disagree on the mesh or the model, a stalled peer in ``clip_grad_norm_``, and worlds
re-created in one process."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import hsdp
from hsdp.topology.communicators import comm_groups, host_group

H, ROWS, STEPS = 8, 2, 3
LR, MOMENTUM = 0.1, 0.9
TIMEOUT_S = 3.0


def _model(out: int = 1, blocks: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(blocks)),
                         nn.Linear(H, out))


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world * ROWS, H, generator=g), torch.randn(world * ROWS, 1, generator=g)


def _shard(model: nn.Sequential, mesh, skip: int | None = None, **opts) -> None:
    for i, block in enumerate(model[:-1]):
        if i != skip:
            hsdp.fully_shard(block, mesh=mesh, **opts)
    hsdp.fully_shard(model, mesh=mesh, **opts)


def _train(model: nn.Module, rank: int | None, world: int, clip: float | None = None) -> None:
    """SGD with momentum on the global batch (rank None: all of it, in one process)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        x, y = _batch(step, world)
        if rank is not None:
            x, y = x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]
        out = model(x)
        ((out[:, :1] - y) ** 2).mean().backward()
        if clip is not None:
            norm = hsdp.clip_grad_norm_(model, clip) if rank is not None else \
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert torch.isfinite(norm)
        opt.step()
        opt.zero_grad()


def _rel_err(model: nn.Module, ref: nn.Module) -> float:
    got = hsdp.full_state_dict(model)
    want = ref.state_dict()
    return max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)


# Ranks that built different models: (what rank 3 does differently, fully_shard options of
# rank 3, options of the others). Every case must raise on every rank at the first forward.
MISMATCHES = {
    "head": ({}, {}),
    "strategy": ({"strategy": "hfsdp"}, {}),
    "mp_policy": ({"mp_policy": hsdp.MixedPrecision(param_dtype=torch.float64)}, {}),
    "overlap": ({"overlap_outer": False}, {}),
    "units": ({}, {}),
}


def model_mismatch_job(rank: int, world: int) -> dict:
    """Each case of MISMATCHES, then a model every rank agrees on (checked against one
    process), all on one mesh: an agreement error leaves the mesh usable."""
    mesh = hsdp.init_mesh(2, 2, "cpu", timeout=timedelta(seconds=60))
    out: dict = {}
    for case, (odd, usual) in MISMATCHES.items():
        model = _model(out=2 if case == "head" and rank == 3 else 1)
        _shard(model, mesh, skip=1 if case == "units" and rank == 3 else None,
               **(odd if rank == 3 else usual))
        try:
            _train(model, rank, world)
            out[case] = "trained"
        except (RuntimeError, ValueError) as exc:
            out[case] = str(exc)
    model, ref = _model(), _model()
    _shard(model, mesh)
    _train(model, rank, world, clip=0.5)
    _train(ref, None, world, clip=0.5)
    out["rel_err"] = _rel_err(model, ref)
    return out


def mesh_args_job(rank: int, world: int) -> dict:
    """Rank 0 asks for a 2x2 mesh, the others for 1x4; then all for 2x2 (the world is
    still usable); then rank 3 does not call init_mesh (last: it leaves the ranks' counts
    of init_mesh calls apart)."""
    timeout = timedelta(seconds=TIMEOUT_S)
    out: dict = {}
    for case, args in (("shape", (2, 2) if rank == 0 else (1, 4)), ("agreed", (2, 2)),
                       ("absent", (2, 2))):
        t0 = time.monotonic()
        try:
            if not (case == "absent" and rank == 3):
                out["shape after"] = tuple(hsdp.init_mesh(*args, "cpu", timeout=timeout).shape)
            out[case] = "built"
        except (RuntimeError, ValueError) as exc:
            out[case] = str(exc)
        out[f"{case} seconds"] = time.monotonic() - t0
        dist.barrier()
    return out


def expert_mesh_args_job(rank: int, world: int) -> dict:
    """On a (1, 4) mesh: rank 0 asks for the expert mesh of ep=2, the others for ep=4;
    then all for ep=2 (the world is still usable); then rank 3 does not call it."""
    mesh = hsdp.init_mesh(1, 4, "cpu", timeout=timedelta(seconds=TIMEOUT_S))
    out: dict = {}
    for case, ep in (("ep", 2 if rank == 0 else 4), ("agreed", 2), ("absent", 2)):
        t0 = time.monotonic()
        try:
            if not (case == "absent" and rank == 3):
                out["shape after"] = tuple(hsdp.expert_mesh(mesh, ep).shape)
            out[case] = "built"
        except (RuntimeError, ValueError) as exc:
            out[case] = str(exc)
        out[f"{case} seconds"] = time.monotonic() - t0
        dist.barrier()
    return out


def clip_stall_job(rank: int, world: int) -> dict:
    """Rank 3 stalls after step 1's backward; the others call clip_grad_norm_."""
    mesh = hsdp.init_mesh(2, 2, "cpu", timeout=timedelta(seconds=TIMEOUT_S))
    model = _model()
    _shard(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    store = dist.distributed_c10d._get_default_store()
    out: dict = {}
    for step in range(2):
        x, y = _batch(step, world)
        ((model(x[rank * ROWS:(rank + 1) * ROWS]) - y[rank * ROWS:(rank + 1) * ROWS]) ** 2
         ).mean().backward()
        if step == 1 and rank == 3:
            store.wait([f"done{r}" for r in range(3)], timedelta(seconds=120))
            return out
        t0 = time.monotonic()
        try:
            hsdp.clip_grad_norm_(model, 1.0)
        except RuntimeError as exc:
            out["error"] = str(exc)
            out["seconds"] = time.monotonic() - t0
            store.set(f"done{rank}", "1")
            return out
        opt.step()
        opt.zero_grad()
    return out


def _resources() -> tuple[int, int, int]:
    """Python threads, OS threads (gloo's are not Python's), open file descriptors."""
    return (threading.active_count(), len(os.listdir("/proc/self/task")),
            len(os.listdir("/proc/self/fd")))


def _live(pg: dist.ProcessGroup) -> bool:
    """``pg`` belongs to the current world (not to a destroyed one)."""
    return pg in dist.distributed_c10d._world.pg_map


def reinit_job(rank: int, world: int, store_dir: str, worlds: int) -> dict:
    """``worlds`` worlds, one after the other in this process (destroy, then a new default
    group), each training a model with clipping and calling init_mesh twice; then
    ``worlds`` more init_mesh calls in the last world. Resources are counted after each."""
    out: dict = {"worlds": [], "meshes": [], "stale": [], "reused": [],
                 "rel_err": []}
    for i in range(worlds):
        if i:
            dist.destroy_process_group()
            store = dist.FileStore(os.path.join(store_dir, f"world{i}"), world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        mesh = hsdp.init_mesh(2, 2, "cpu")
        comms = comm_groups(mesh)
        out["stale"].append(not (_live(comms.control) and _live(comms.outer)
                                 and _live(host_group())))
        out["reused"].append(hsdp.init_mesh(2, 2, "cpu") is mesh)  # same arguments
        model, ref = _model(), _model()
        _shard(model, mesh)
        _train(model, rank, world, clip=0.5)
        _train(ref, None, world, clip=0.5)
        out["rel_err"].append(_rel_err(model, ref))
        hsdp.full_state_dict(model)  # uses host_group()
        del model
        out["worlds"].append(_resources())
    for _ in range(worlds):
        hsdp.init_mesh(2, 2, "cpu")
        out["meshes"].append(_resources())
    return out
