"""One rank of the DiLoCo + fault tolerance test (``test_ft_diloco.py``).

One process per rank runs ``main(cfg)``: the tests start it from the preloaded fork
server (``dist_utils.Forked``); by hand, ``python tests/ft_diloco_jobs.py CONFIG_JSON``.
``world`` 2: one replica group of a fault-tolerant mesh (its own gloo world, the outer
axis torchft's); ``world`` 4: the same training without fault tolerance, one 2 x 2 world.
Every rank writes, after each optimizer step, the full parameters, its own groups'
anchors and shard parameters, and (fault tolerant) torchft's step and participants.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from diloco_jobs import _error
from ft_jobs import _touch, _wait_for, _wait_for_joiner, batch, build_model, make_optimizer

import hsdp
from hsdp.checkpoint.extra_state import extra_state

# 3 units, so 3 fragments: the root's (no parameters) never syncs, the two linears' sync
# after steps 1, 5, 9, ... and 3, 7, 11, ..., each applied one step later
DILOCO = hsdp.DiLoCo(inner_steps=4, fragments=3, outer_lr=0.7, momentum=0.9, delay=1)


def _mesh(cfg: dict) -> Any:
    if cfg["world"] == 4:
        return hsdp.init_mesh(2, 2, "cpu", outer_sync=DILOCO)
    ft = hsdp.FaultTolerance(lighthouse=cfg["lighthouse"], replica_id=str(cfg["replica"]),
                             timeout=timedelta(seconds=cfg["timeout_s"]))
    mesh = hsdp.init_mesh(2, 2, "cpu", fault_tolerance=ft, outer_sync=DILOCO)
    if cfg.get("check_refusals"):  # what DiLoCo with fault tolerance still refuses
        refused = {
            "hfsdp": _error(lambda: hsdp.fully_shard(nn.Linear(2, 2), mesh=mesh,
                                                     strategy="hfsdp")),
            "outer_reduce": _error(lambda: hsdp.fully_shard(
                nn.Linear(2, 2), mesh=mesh, outer_reduce=hsdp.OuterReduce("int8"))),
            "other_sync": _error(lambda: hsdp.init_mesh(2, 2, "cpu", fault_tolerance=ft)),
        }
        with open(os.path.join(cfg["out"], f"refused_{cfg['rank']}.json"), "w") as f:
            json.dump(refused, f)
    return mesh


def main(cfg: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]),
                      RANK=str(cfg["rank"]), WORLD_SIZE=str(cfg["world"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=cfg["rank"], world_size=cfg["world"])
    try:
        mesh = _mesh(cfg)
        model = build_model(cfg["seed"])
        for layer in (model[0], model[2]):
            hsdp.fully_shard(layer, mesh=mesh)
        hsdp.fully_shard(model, mesh=mesh)
        opt, sched = make_optimizer(model)
        manager = hsdp.fault_tolerance(model, opt, sched) if cfg["world"] == 2 else None
        if cfg.get("die_after_quorum"):  # dies once it took part in a quorum (recovered)
            start = manager.start_quorum

            def start_then_die(*args: Any, **kwargs: Any) -> None:
                start(*args, **kwargs)
                _touch(os.path.join(cfg["out"], f"quorum_{cfg['tag']}_{cfg['rank']}"))
                os.kill(os.getpid(), signal.SIGKILL)
            manager.start_quorum = start_then_die
        _touch(os.path.join(cfg["out"], f"ready_{cfg['tag']}_{cfg['rank']}"))
        train(cfg, model, opt, sched, manager)
        hsdp.synchronize(model)
        if manager is not None:
            manager.shutdown(wait=False)
    finally:
        dist.destroy_process_group()


def train(cfg: dict, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
          manager: Any) -> None:
    """DiLoCo's plain loop: no quorum or commit in it (hsdp runs them in the step). The
    step comes from the LR scheduler, which a recovering group receives."""
    rank = cfg["rank"]
    replica, inner = (cfg["replica"], rank) if manager is not None else divmod(rank, 2)
    gates = {int(s): f for s, f in cfg.get("gates", {}).items()}
    while sched.last_epoch < cfg["steps"]:
        step = sched.last_epoch
        if step in gates:
            gate = gates.pop(step)
            for r in range(2):
                _wait_for(os.path.join(cfg["out"], f"{gate}_{r}"), 180)
            if cfg.get("await_joiner"):
                _wait_for_joiner(cfg["lighthouse"], 180)
        x, y = batch(step, replica, inner)
        loss = nn.functional.mse_loss(model(x), y)
        if step == cfg.get("kill_at"):  # mid-period: no sync in flight
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        # the step just taken (a group that recovered in it received the scheduler)
        record(cfg, sched.last_epoch - 1, model, manager)


@torch.no_grad()
def record(cfg: dict, step: int, model: nn.Module, manager: Any) -> None:
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    # this rank's anchors and shard parameters, keyed without the mesh shape
    state = extra_state(model, None).get(hsdp.DiLoCo.state_key, {})
    local = {k.split("@")[0] + "/" + k.rsplit("/", 1)[1]: v
             for k, v in state.items() if k.endswith(("/anchor", "/main"))}
    rec = {"params": params, "local": local}
    if manager is not None:
        rec.update(commits=manager.current_step(), participants=manager.num_participants())
    torch.save(rec, os.path.join(cfg["out"], f"{cfg['tag']}_r{cfg['rank']}_step{step}.pt"))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
