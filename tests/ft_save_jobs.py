"""One rank of one torchft replica group for ``test_ft_save.py``: every replica group
calls ``hsdp.save`` on the same path after the same committed step, as a fault-tolerant
loop that saves from every group does. A hook holds group 0's save between its write and
its publish until group 1 has tried, so group 1's save meets a save in progress.

One process per rank runs ``main(cfg)``: the tests start it from the preloaded fork
server (``dist_utils.Forked``); by hand, ``python tests/ft_save_jobs.py CONFIG_JSON``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from ft_jobs import _touch, _wait_for, batch, build_model, make_optimizer

import hsdp
import hsdp.checkpoint.dcp


def _hold_publish(out: str) -> None:
    """Group 0: once rank 0 has sealed the checkpoint, wait for group 1's attempt."""
    writer = hsdp.checkpoint.dcp.CheckpointWriter
    original = writer.finish

    def finish(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _touch(os.path.join(out, "g0_written"))
        _wait_for(os.path.join(out, "g1_tried"), 180)

    writer.finish = finish


def save(cfg: dict, model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """What the documented loop does: save, and let another group's save go on."""
    try:
        hsdp.save(cfg["path"], model, opt)
        return "saved"
    except hsdp.CheckpointBusyError as e:
        return f"busy: {e}"


def main(cfg: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]),
                      RANK=str(cfg["rank"]), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=cfg["rank"], world_size=2)
    out, replica, rank = cfg["out"], cfg["replica"], cfg["rank"]
    try:
        ft = hsdp.FaultTolerance(lighthouse=cfg["lighthouse"], replica_id=str(replica),
                                 min_replicas=2, timeout=timedelta(seconds=30),
                                 connect_timeout=timedelta(seconds=30))
        mesh = hsdp.init_mesh(2, 2, device_type="cpu", fault_tolerance=ft)
        model = build_model(cfg["seed"])
        for layer in (model[0], model[2]):
            hsdp.fully_shard(layer, mesh=mesh)
        hsdp.fully_shard(model, mesh=mesh)
        opt, sched = make_optimizer(model)
        manager = hsdp.fault_tolerance(model, opt, sched)
        if replica == 0:
            _hold_publish(out)
        result = {}
        while manager.current_step() < cfg["steps"]:
            step = manager.current_step()
            manager.start_quorum()
            x, y = batch(step, replica, rank)
            nn.functional.mse_loss(model(x), y).backward()
            if manager.should_commit():
                opt.step()
                sched.step()
            opt.zero_grad()
            if step == cfg["save_at"]:
                with torch.no_grad():
                    result["params"] = {n: p.full_tensor() for n, p in
                                        model.named_parameters()}
                if replica == 1:
                    _wait_for(os.path.join(out, "g0_written"), 180)
                    t0 = time.monotonic()
                    result["save"] = save(cfg, model, opt)
                    result["seconds"] = time.monotonic() - t0
                    dist.barrier()
                    if rank == 0:
                        _touch(os.path.join(out, "g1_tried"))
                else:
                    result["save"] = save(cfg, model, opt)
        result["steps"] = manager.current_step()
        torch.save(result, os.path.join(out, f"g{replica}_r{rank}.pt"))
        hsdp.synchronize(model)
        manager.shutdown(wait=False)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
