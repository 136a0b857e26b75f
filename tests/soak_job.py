"""Soak job: many steps with random per-rank delays before collectives, against the same
steps without them (tests/dist/test_soak.py on CPU, tests/gpu/test_multi_gpu.py on GPUs).

Each rank delays the collectives of some streams by a random time before issuing them
(rank r: the ag, rs or outer stream by r mod 3; the last rank all three), so that ranks
reach each collective at different times and in different interleavings of their
streams. A correct schedule neither hangs nor changes a single bit of the result.
"""

from __future__ import annotations

import os
import random
import time

import torch
import torch.nn as nn

import hsdp
from hsdp.sharding.comm import Collectives

DELAYED = (("ag",), ("rs",), ("outer",), ("ag", "rs", "outer"))
MAX_DELAY_S = 1e-3
WIDTH, UNITS, ROWS = 24, 4, 4


def stream_of(kind: str, axis: str) -> str:
    """The stream hsdp issues a collective on (the serialized baseline aside)."""
    if axis == "outer":
        return "outer"
    return "ag" if kind == "all_gather" else "rs"


class JitterCollectives(Collectives):
    """hsdp's collectives, each on ``streams`` first delayed by a random time (a device
    sleep on the collective's stream on GPU, a host sleep on its worker thread on CPU)."""

    def __init__(self, streams: tuple[str, ...], seed: int, cuda: bool) -> None:
        super().__init__()
        self.streams = streams
        self.rng = random.Random(seed)
        self.cuda = cuda
        self.delays = 0

    def before(self, kind: str, axis: str, nbytes: int, group_size: int) -> None:
        if stream_of(kind, axis) not in self.streams:
            return
        seconds = self.rng.uniform(0.0, MAX_DELAY_S)
        self.delays += 1
        if self.cuda:
            torch.cuda._sleep(int(seconds * 2e9))  # about 2 GHz: a rough delay is enough
        else:
            time.sleep(seconds)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(UNITS))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def soak_job(rank: int, world: int, outer: int, steps: int, device_type: str,
             microbatches: int = 2) -> dict[str, dict]:
    """Per (strategy, overlap): whether the delayed run's parameters equal the undelayed
    run's bit for bit, and how many delays were injected."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic GEMMs
    cuda = device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = hsdp.init_mesh(outer, world // outer, device_type)
    streams = DELAYED[-1] if rank == world - 1 else DELAYED[rank % (len(DELAYED) - 1)]
    out = {}
    for strategy in ("hsdp", "hfsdp"):
        for overlap in (True, False):
            states, delays = [], 0
            for delayed in (False, True):
                torch.manual_seed(0)
                model = Net().to(device)
                for unit in [*model.blocks, model]:
                    hsdp.fully_shard(unit, mesh=mesh, strategy=strategy, overlap_outer=overlap)
                jitter = JitterCollectives(streams, seed=1000 * rank + 7, cuda=cuda)
                if delayed:
                    model._hsdp_unit.collectives = jitter
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                g = torch.Generator().manual_seed(rank)
                for _ in range(steps):
                    for m in range(microbatches):
                        x = torch.randn(ROWS, WIDTH, generator=g).to(device)
                        y = torch.randn(ROWS, 3, generator=g).to(device)
                        with hsdp.microbatch(model, is_last=m == microbatches - 1):
                            (nn.functional.mse_loss(model(x), y) / microbatches).backward()
                    opt.step()
                    opt.zero_grad()
                hsdp.synchronize(model)
                states.append(hsdp.full_state_dict(model))
                delays += jitter.delays
            plain, jittered = states
            out[f"{strategy}/{'overlap' if overlap else 'serial'}"] = {
                "identical": plain.keys() == jittered.keys() and all(
                    torch.equal(plain[k], jittered[k]) for k in plain),
                "delays": delays}
    return out
