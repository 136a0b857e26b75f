"""Emulated clusters on one device: torch's fake process group plus modelled delays.

With a ``Fabric``, each collective is preceded by a delay of its modelled duration on the
same stream (``torch.cuda._sleep`` on GPU, ``time.sleep`` on CPU). Under torch's ``fake``
process group the collective itself does nothing, so the delay is the whole cost: the real
schedule, streams and compute, with the network of a cluster we do not have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.sharding.comm import Collectives
from hsdp.topology.mesh import init_mesh
from hsdp_tools.sim.fabric import Fabric


@dataclass
class SleepClock:
    """Turns seconds into a device delay on the current CUDA stream (calibrated)."""

    cycles_per_s: float

    @staticmethod
    def calibrate(device: torch.device, probe_cycles: int = 20_000_000) -> SleepClock:
        with torch.cuda.device(device):
            torch.cuda._sleep(probe_cycles // 10)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            torch.cuda._sleep(probe_cycles)
            end.record()
            end.synchronize()
        return SleepClock(probe_cycles / (start.elapsed_time(end) * 1e-3))

    def check(self, seconds: float = 2e-3, repeats: int = 5) -> float:
        """Relative error of a calibrated delay of ``seconds`` measured again now (median
        of ``repeats``)."""
        errs = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self(seconds)
            end.record()
            end.synchronize()
            errs.append(start.elapsed_time(end) * 1e-3 / seconds - 1.0)
        return sorted(errs)[len(errs) // 2]

    def __call__(self, seconds: float) -> None:
        if seconds > 0:
            torch.cuda._sleep(int(seconds * self.cycles_per_s))


def _host_sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class DelayedCollectives(Collectives):
    """hsdp's collectives, each preceded by its duration on ``fabric`` (None: no delay),
    slept by ``sleep`` (a ``SleepClock`` on CUDA; default: the host's)."""

    def __init__(self, fabric: Fabric | None = None,
                 sleep: Callable[[float], None] | None = None) -> None:
        super().__init__()
        self.fabric = fabric
        self._sleep = sleep or _host_sleep

    def before(self, kind: str, axis: str, nbytes: int, group_size: int) -> None:
        if self.fabric is not None:
            self._sleep(self.fabric.seconds(kind, axis, nbytes, group_size))


def fake_mesh(outer: int, inner: int, device_type: str, tp: int = 1) -> DeviceMesh:
    """Pose as rank 0 of an ``outer x inner x tp`` world: collectives return at once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=outer * inner * tp,
                                store=FakeStore())
    return init_mesh(outer, inner, device_type, tp=tp)


def emulate(model: nn.Module, fabric: Fabric | None, device: torch.device) -> float | None:
    """Give the model's root unit collectives delayed by ``fabric`` (None: no delays).
    Must run before the first forward. Returns the calibration error of the device sleep
    (relative, CUDA) or None."""
    unit = getattr(model, "_hsdp_unit", None)
    if unit is None or unit.runtime is not None:
        raise RuntimeError("emulate() needs a fully_shard-ed root before its first forward")
    if fabric is None or device.type != "cuda":
        unit.collectives = DelayedCollectives(fabric)
        return None
    clock = SleepClock.calibrate(device)
    unit.collectives = DelayedCollectives(fabric, clock)
    return clock.check()
