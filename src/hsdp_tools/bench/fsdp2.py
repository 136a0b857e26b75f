"""torch FSDP2 as the benchmark peer: HSDP on hsdp's mesh, with observable collectives.

FSDP2 runs its inner all-gather, inner reduce-scatter and outer all-reduce on three CUDA
streams of its own, through ``torch.distributed`` functions on the mesh's "inner" and
"outer" groups (``hsdp_tools.bench.intercept`` delays and traces them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.sharding.policy import MixedPrecision
from hsdp.streams.contract import Tracer
from hsdp_tools.bench.intercept import intercept
from hsdp_tools.sim.fabric import Fabric


def shard_fsdp2(model: nn.Module, units: list[tuple], mesh: DeviceMesh,
                mp: MixedPrecision) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` on each unit ((module,
    ``reshard_after_forward``[, its mesh: default ``mesh``])), then on the root (HSDP on a
    2-D mesh: replicate over "outer", shard over "inner"), with ``mp``'s dtypes. A unit on
    another mesh (an MoE block's experts, on the expert mesh) averages its gradients over
    all of ``mesh``'s ranks, as torchtitan sets it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
    for unit, reshard, *own in units:
        unit_mesh = own[0] if own else mesh
        fully_shard(unit, mesh=unit_mesh, mp_policy=policy, reshard_after_forward=reshard)
        if unit_mesh is not mesh:
            unit.set_gradient_divide_factor(float(mesh.size()))
            if mesh.device_type == "cpu":  # gloo has no PREMUL_SUM
                unit.set_force_sum_reduction_for_comms(True)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp2_collectives(meshes: list[DeviceMesh], tracer: Tracer, nbytes: dict[str, int],
                      fabric: Fabric | None = None,
                      sleep: Callable[[float], None] = time.sleep) -> AbstractContextManager:
    """Within the block, FSDP2's collectives on the groups of ``meshes`` (each an
    ("outer", "inner") mesh) are delayed by ``fabric`` (if given, using ``sleep``: a
    ``hsdp_tools.bench.emulate.SleepClock`` on CUDA), traced into ``tracer`` and their bytes
    counted in ``nbytes``."""
    axes = {id(m.get_group(axis)): axis for m in meshes for axis in ("inner", "outer")}
    return intercept(axes, tracer, fabric, sleep, nbytes=nbytes)
