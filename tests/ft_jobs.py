"""One rank of one replica group of the fault-tolerance tests (``test_fault_tolerance.py``).

One process per rank runs ``main(cfg)``: the tests start it from the preloaded fork
server (``dist_utils.Forked``); by hand, ``python tests/ft_jobs.py CONFIG_JSON``. Each
replica group is its own gloo world of two ranks; the outer axis is torchft's. Rank 0 of
the group writes, for each committed step, the full parameters, momentum buffers, lr, the
number of participating replica groups and whether this group took part.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import hsdp

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 4
LR, MOMENTUM = 0.05, 0.9


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(step: int, replica: int, inner_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of inner rank ``inner_rank`` of replica group ``replica`` at ``step``."""
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + inner_rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)


def _wait_for(path: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {seconds} s")
        time.sleep(0.05)


def _wait_for_joiner(lighthouse: str, seconds: float) -> None:
    """Until another replica group's quorum request is pending at the lighthouse: a group
    that requests first, alone, gets a fast quorum without the newcomer (torchft 0.2)."""
    deadline = time.monotonic() + seconds
    while True:
        with urllib.request.urlopen(f"{lighthouse}/status", timeout=seconds) as f:
            status = f.read().decode()
        pending = re.search(r"only have (\d+) participants", status)
        if pending and int(pending.group(1)) > 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no quorum request pending at {lighthouse} in {seconds} s:"
                               f" {status}")
        time.sleep(0.05)


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def _dying_transport(cfg: dict, timeout: timedelta) -> Any:
    """torchft's HTTP transport (the FSDP2 peer's), except that receiving a checkpoint
    kills this process once the transfer's first bytes have arrived."""
    from torchft.checkpointing import HTTPTransport

    class DiesMidTransfer(HTTPTransport):
        def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                            timeout: timedelta) -> Any:
            with urllib.request.urlopen(f"{metadata}{step}/full",
                                        timeout=timeout.total_seconds()) as f:
                f.read(64)
                _die_mid_transfer(cfg)
            raise AssertionError("unreachable")

    return DiesMidTransfer(timeout=timeout, num_chunks=0)


def _die_mid_transfer(cfg: dict) -> None:
    _touch(os.path.join(cfg["out"], f"mid_transfer_{cfg['tag']}_{cfg['rank']}"))
    os.kill(os.getpid(), signal.SIGKILL)


class _DiesOnRecv:
    """torchft's process group as hsdp's recovery sees it, except that receiving kills
    this process once the first message (the header) has arrived."""

    def __init__(self, pg: Any, cfg: dict) -> None:
        self.pg, self.cfg = pg, cfg

    def send(self, tensors: list, dst: int, tag: int) -> Any:
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors: list, src: int, tag: int) -> Any:
        self.pg.recv(tensors, src, tag).wait()
        _die_mid_transfer(cfg=self.cfg)


class _SenderDies(hsdp.RecoveryTransport):
    """hsdp's recovery, except that the ranks in ``cfg["die_sending"]`` die when asked to
    send, once the group's other ranks have sent everything (so that the recovering
    group's ranks paired with them have received it all: the split a recovery must
    survive)."""

    def __init__(self, pg: Any, cfg: dict) -> None:
        super().__init__(pg)
        self.cfg = cfg

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any,
                        timeout: timedelta) -> None:
        out, rank, dying = self.cfg["out"], self.cfg["rank"], self.cfg["die_sending"]
        if rank not in dying:
            super().send_checkpoint(dst_ranks, step, state_dict, timeout)
            _touch(os.path.join(out, f"sent_{self.cfg['tag']}_{rank}"))
            return
        for r in sorted(set(range(2)) - set(dying)):
            _wait_for(os.path.join(out, f"sent_{self.cfg['tag']}_{r}"), 120)
        _touch(os.path.join(out, f"dies_sending_{self.cfg['tag']}_{rank}"))
        os.kill(os.getpid(), signal.SIGKILL)


def _manager(cfg: dict, transport: Any = None) -> Any:
    """A torchft Manager made by hand (what init_mesh also takes as it is); ``transport``
    builds its checkpoint transport from its process group (default: torchft's)."""
    import torchft

    timeout = timedelta(seconds=cfg["timeout_s"])
    pg = torchft.ProcessGroupGloo(timeout=timeout)
    return torchft.Manager(
        pg=pg, load_state_dict=None, state_dict=None,
        min_replica_size=1, timeout=timeout, rank=cfg["rank"], world_size=2, init_sync=False,
        lighthouse_addr=cfg["lighthouse"], replica_id=str(cfg["replica"]),
        checkpoint_transport=None if transport is None else transport(pg))


def _fault_tolerance(cfg: dict) -> Any:
    if cfg.get("die_in_transfer"):
        return _manager(cfg, lambda pg: hsdp.RecoveryTransport(_DiesOnRecv(pg, cfg)))
    if cfg.get("die_sending"):
        return _manager(cfg, lambda pg: _SenderDies(pg, cfg))
    return hsdp.FaultTolerance(lighthouse=cfg["lighthouse"], replica_id=str(cfg["replica"]),
                               min_replicas=1, timeout=timedelta(seconds=cfg["timeout_s"]),
                               connect_timeout=timedelta(seconds=cfg["connect_s"]),
                               allow_lost_progress=cfg.get("allow_lost_progress", False))


def _hsdp(cfg: dict) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    mesh = hsdp.init_mesh(len(cfg["replicas"]), 2, device_type="cpu",
                          fault_tolerance=_fault_tolerance(cfg))
    if cfg.get("check_hfsdp"):
        try:
            hsdp.fully_shard(nn.Linear(2, 2), mesh=mesh, strategy="hfsdp")
        except hsdp.FaultToleranceError:
            _touch(os.path.join(cfg["out"], f"hfsdp_refused_{cfg['rank']}"))
    model = build_model(cfg["seed"])
    for layer in (model[0], model[2]):
        hsdp.fully_shard(layer, mesh=mesh)
    hsdp.fully_shard(model, mesh=mesh)
    opt, sched = make_optimizer(model)
    if cfg.get("numpy_lr"):  # a schedule computed with numpy: state weights_only rejects
        for g in opt.param_groups:
            g["lr"] = np.float64(g["lr"])
    return model, opt, sched, hsdp.fault_tolerance(model, opt, sched)


def _fsdp2(cfg: dict) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """The peer: torch FSDP2 over the replica group's ranks, torchft wired by hand (the
    outer all-reduce in FSDP2's all-reduce hook, the recovery state written out)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    manager = _manager(cfg, (lambda pg: _dying_transport(cfg, timedelta(seconds=cfg["timeout_s"])))
                       if cfg.get("die_in_transfer") else None)
    mesh = init_device_mesh("cpu", (2,))
    model = build_model(cfg["seed"])
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(
                lambda t: manager.allreduce(t, reduce_op=dist.ReduceOp.AVG).wait())
    opt, sched = make_optimizer(model)
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}

    def state_dict() -> dict:
        return {"params": {n: p._local_tensor.detach() for n, p in params.items()},
                "optim": {names[id(p)]: {k: v._local_tensor for k, v in st.items()}
                          for p, st in opt.state.items()},
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in opt.param_groups],
                "sched": sched.state_dict()}

    @torch.no_grad()
    def load_state_dict(sd: dict) -> None:
        for n, p in params.items():
            p._local_tensor.copy_(sd["params"][n])
        for n, st in sd["optim"].items():
            p = params[n]
            for k, v in st.items():
                opt.state[p][k] = DTensor.from_local(v.clone(), p.device_mesh, p.placements,
                                                     shape=p.shape, stride=p.stride())
        for mine, theirs in zip(opt.param_groups, sd["param_groups"]):
            mine.update(theirs)
        sched.load_state_dict(sd["sched"])

    manager.register_state_dict_fn("fsdp2", load_state_dict, state_dict)
    return model, opt, sched, manager


def main(cfg: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]),
                      RANK=str(cfg["rank"]), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=cfg["rank"], world_size=2)
    try:
        model, opt, sched, manager = (_fsdp2 if cfg["library"] == "fsdp2" else _hsdp)(cfg)
        _touch(os.path.join(cfg["out"], f"ready_{cfg['tag']}_{cfg['rank']}"))
        train(cfg, model, opt, sched, manager)
        if cfg["library"] == "hsdp":
            hsdp.synchronize(model)
        manager.shutdown(wait=False)
    finally:
        dist.destroy_process_group()


def train(cfg: dict, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
          manager: Any) -> None:
    rank, replica = cfg["rank"], cfg["replica"]
    gates = {int(s): f for s, f in cfg.get("gates", {}).items()}
    while manager.current_step() < cfg["steps"]:
        step = manager.current_step()
        if step in gates:  # the first attempt only: a step redone after a loss goes on
            gate = gates.pop(step)
            for r in range(2):
                _wait_for(os.path.join(cfg["out"], f"{gate}_{r}"), 180)
            if cfg.get("await_joiner"):
                _wait_for_joiner(cfg["lighthouse"], 180)
        manager.start_quorum()
        x, y = batch(step, replica, rank)
        loss = nn.functional.mse_loss(model(x), y)
        if step == cfg.get("kill_at"):  # mid-step: after this group joined the quorum
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        took_part = manager.is_participating()
        if manager.should_commit():
            opt.step()
            sched.step()
            # the step just committed (a recovering group received its step counter)
            record(cfg, manager.current_step() - 1, model, opt, manager.num_participants(),
                   took_part)
        opt.zero_grad()


@torch.no_grad()
def record(cfg: dict, step: int, model: nn.Module, opt: torch.optim.Optimizer,
           participants: int, took_part: bool) -> None:
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    momenta = {n: opt.state[p]["momentum_buffer"].full_tensor()
               for n, p in model.named_parameters()}
    if cfg["rank"] == 0:
        torch.save({"params": params, "momenta": momenta, "lr": float(opt.param_groups[0]["lr"]),
                    "participants": participants, "took_part": took_part},
                   os.path.join(cfg["out"], f"{cfg['tag']}_step{step}.pt"))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
