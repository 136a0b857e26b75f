"""Training that survives losing a replica group (README, "Surviving failures"), runnable.

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 &
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --nproc-per-node 2 --master-port 29600 examples/ft_train.py --outer 2 &
    REPLICA_GROUP_ID=1 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --nproc-per-node 2 --master-port 29601 examples/ft_train.py --outer 2

Each torchrun is one replica group (its world is the inner axis; ``--outer`` the number of
groups launched). Kill one group's torchrun and the other trains on alone; start it again
with the same command and it receives the live group's weights, optimizer and scheduler
state and step, then trains in lockstep. Inner rank 0 of each group logs every step:
whether it committed, the steps committed so far, the replica groups that took part and
its loss. On CPU (gloo) by
default, on the GPUs when there are some. ``--step-s`` slows each step down, so that
there is time to kill and restart a group by hand.
"""

from __future__ import annotations

import argparse
import os
import time
import zlib

import torch
import torch.nn as nn

import hsdp

WIDTH, DEPTH, BATCH = 64, 4, 16


def batch(step: int, replica: str, inner_rank: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets at ``step``: a fixed linear map plus noise."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{step}/{replica}/{inner_rank}".encode()))
    x = torch.randn(BATCH, WIDTH, generator=g)
    w = torch.Generator().manual_seed(0)
    target = x @ torch.randn(WIDTH, WIDTH, generator=w) / WIDTH**0.5
    return x.to(device), (target + 0.01 * torch.randn(BATCH, WIDTH, generator=g)).to(device)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--outer", type=int, required=True, help="replica groups launched")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-s", type=float, default=0.1, help="seconds added to each step")
    args = p.parse_args()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # inner = this torchrun's world; the lighthouse and replica id come from the environment
    mesh = hsdp.init_mesh(args.outer, int(os.environ["WORLD_SIZE"]), device_type=device_type,
                          fault_tolerance=hsdp.FaultTolerance(min_replicas=1))
    torch.manual_seed(0)  # every replica group builds the same initial model
    with torch.device(device_type):
        model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                for _ in range(DEPTH)), nn.Linear(WIDTH, WIDTH))
    for block in model:
        hsdp.fully_shard(block, mesh=mesh)
    hsdp.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    manager = hsdp.fault_tolerance(model, opt, sched)  # this rank's torchft Manager
    replica, rank = os.environ["REPLICA_GROUP_ID"], int(os.environ["RANK"])
    while manager.current_step() < args.steps:
        manager.start_quorum()  # before the forward
        x, target = batch(manager.current_step(), replica, rank, torch.device(device_type))
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()  # the outer all-reduce over the live groups
        recovering = not manager.is_participating()  # known once the backward has run
        committed = manager.should_commit()  # False on every survivor if a group failed
        if committed:
            opt.step()
            sched.step()
        opt.zero_grad()
        if rank == 0:
            print(f"replica group {replica}: {'committed' if committed else 'discarded'} "
                  f"step {manager.current_step()}, {manager.num_participants()} group(s) "
                  f"took part{', this one received their state' if recovering else ''}, "
                  f"loss {loss.item():.4f}", flush=True)
        time.sleep(args.step_s)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
