"""torch FSDP2 as the benchmark peer: HSDP on hsdp's mesh, with observable collectives.

FSDP2 runs its inner all-gather, inner reduce-scatter and outer all-reduce on three CUDA
streams of its own, through ``torch.distributed`` functions on the mesh's "inner" and
"outer" groups (``hsdp.bench.intercept`` delays and traces them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.bench.intercept import intercept
from hsdp.sharding.policy import MixedPrecision
from hsdp.sim.fabric import Fabric
from hsdp.streams.contract import Tracer


def shard_fsdp2(model: nn.Module, units: list[tuple[nn.Module, bool]], mesh: DeviceMesh,
                mp: MixedPrecision) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` on each unit (with its
    ``reshard_after_forward``), then on the root (HSDP on a 2-D mesh: replicate over
    "outer", shard over "inner"), with ``mp``'s dtypes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
    for unit, reshard in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp2_collectives(mesh: DeviceMesh, tracer: Tracer, nbytes: dict[str, int],
                      fabric: Fabric | None = None,
                      sleep: Callable[[float], None] = time.sleep) -> AbstractContextManager:
    """Within the block, FSDP2's collectives on ``mesh`` are delayed by ``fabric`` (if
    given, using ``sleep``: a ``hsdp.bench.emulate.SleepClock`` on CUDA), traced into
    ``tracer`` and their bytes counted in ``nbytes``."""
    axes = {id(mesh.get_group("inner")): "inner", id(mesh.get_group("outer")): "outer"}
    return intercept(axes, tracer, fabric, sleep, nbytes=nbytes)
