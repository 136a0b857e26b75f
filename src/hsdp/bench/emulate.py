"""Emulated clusters on one device: torch's fake process group plus modelled delays."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.comm import Collectives, SleepClock
from hsdp.fabric import Fabric
from hsdp.mesh import init_mesh


def fake_mesh(outer: int, inner: int, device_type: str) -> DeviceMesh:
    """Pose as rank 0 of an ``outer x inner`` world: collectives return at once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=outer * inner, store=FakeStore())
    return init_mesh(outer, inner, device_type)


def emulate(model: nn.Module, fabric: Fabric | None, device: torch.device) -> float | None:
    """Give the model's root unit collectives delayed by ``fabric`` (None: no delays).
    Must run before the first forward. Returns the calibration error of the device sleep
    (relative, CUDA) or None."""
    unit = getattr(model, "_hsdp_unit", None)
    if unit is None or unit.runtime is not None:
        raise RuntimeError("emulate() needs a fully_shard-ed root before its first forward")
    if fabric is None or device.type != "cuda":
        unit.collectives = Collectives(fabric)
        return None
    clock = SleepClock.calibrate(device)
    unit.collectives = Collectives(fabric, clock)
    return clock.check()
