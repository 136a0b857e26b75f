"""Megatron-FSDP as a benchmark peer: HSDP on hsdp's mesh, with observable collectives.

Megatron-FSDP (pip ``megatron-fsdp``; ``pip install 'hsdp[mfsdp]'``) is an optional extra,
imported only when the ``mfsdp`` schedule is asked for. It runs on CUDA only.

Configuration (its own names): ``zero_dp_strategy="optim_grads_params"`` over the mesh's
"inner" dim and ``outer_dp_sharding_strategy="no_shard"`` over "outer" (HSDP: shard inside
a node, replicate across), each block class a ``fsdp_unit_module``; compute weights in the
model's dtype (the module is cast to the parameter dtype first), fp32 main weights,
gradients reduced and accumulated in the reduce dtype. Its inner all-gathers get a
communicator of their own (``fsdp_group_ag``), as hsdp's do, so that they never queue
behind a reduce-scatter. It wants a 3-D mesh with a tensor-parallel dim, so it gets its own
``("outer", "inner", "tp")`` mesh with tp = 1 over the same ranks; the flattened
(outer, inner) group it asks for is the default group (it only reads its size and rank).

Gradient accumulation: ``is_last_microbatch`` is set before each microbatch (outer
all-reduce on the last only) and ``model_auto_sync`` stays off; its optimizer wrapper
finishes the gradient sync in ``optimizer.step()``.

Collectives: inner all-gathers and reduce-scatters and the outer all-reduce go through
``torch.distributed`` inside ``_coalescing_manager`` blocks on Megatron-FSDP's own streams;
its all-gathers are waited through the manager's work handle (see
``hsdp_tools.bench.intercept`` for how emulation keeps compute waiting on them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from hsdp.sharding.policy import MixedPrecision
from hsdp.streams.contract import Tracer
from hsdp_tools.bench.intercept import intercept
from hsdp_tools.sim.fabric import Fabric

INSTALL_HINT = "pip install 'hsdp[mfsdp]' (the megatron-fsdp package)"


class PeerUnavailable(RuntimeError):
    """A benchmark peer cannot run here (not installed, or no GPU)."""


def import_mfsdp() -> ModuleType:
    """The ``megatron_fsdp`` package, or ``PeerUnavailable`` saying how to install it."""
    try:
        import megatron_fsdp
    except ImportError as e:
        raise PeerUnavailable(f"schedule 'mfsdp' needs Megatron-FSDP, which is not "
                              f"installed ({e}): {INSTALL_HINT}") from None
    return megatron_fsdp


@dataclass
class MfsdpModel:
    """The wrapped model, its optimizer and the groups its collectives run on."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    axes: dict[int, str] = field(default_factory=dict)
    coalescing: tuple[ModuleType, ...] = ()

    def microbatch(self, is_last: bool) -> None:
        """Before a microbatch: the outer all-reduce runs on the last one only."""
        self.model.is_last_microbatch = is_last

    def collectives(self, tracer: Tracer, fabric: Fabric | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> AbstractContextManager:
        """Within the block, its collectives are delayed by ``fabric`` and traced."""
        return intercept(self.axes, tracer, fabric, sleep, self.coalescing)


def shard_mfsdp(module: nn.Module, units: list[nn.Module], outer: int, inner: int,
                mp: MixedPrecision, device: torch.device,
                make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                ) -> MfsdpModel:
    """Megatron-FSDP HSDP on an ``outer x inner`` mesh of this job's ranks (module
    docstring); ``make_optimizer`` builds the torch optimizer over its parameters."""
    mfsdp = import_mfsdp()
    if device.type != "cuda":
        raise PeerUnavailable("schedule 'mfsdp': Megatron-FSDP runs on CUDA only")
    from megatron_fsdp import param_and_grad_buffer

    mesh = init_device_mesh("cuda", (outer, inner, 1), mesh_dim_names=("outer", "inner", "tp"))
    ranks = mesh.mesh[:, :, 0].tolist()  # ranks[o][i]
    ag_group = None
    for row in ranks:  # every rank creates every group, in the same order
        g = dist.new_group(row)
        if dist.get_rank() in row:
            ag_group = g
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                        main_grads_dtype=mp.reduce_dtype)
    module = module.to(device=device, dtype=mp.param_dtype)
    model, optimizer = mfsdp.fully_shard(
        module, make_optimizer(list(module.parameters())), device_mesh=mesh,
        dp_shard_dim="inner", dp_outer_dim="outer", tp_dim="tp",
        hybrid_fsdp_group=dist.group.WORLD, fsdp_group_ag=ag_group,
        fsdp_unit_modules=sorted({type(u) for u in units}, key=lambda t: t.__name__),
        zero_dp_strategy="optim_grads_params", outer_dp_sharding_strategy="no_shard",
        device=device, mixed_precision_policy=policy, sync_model_each_microbatch=False,
        preproc_state_dict_for_dcp_ckpt=False)
    axes = {id(mesh.get_group("inner")): "inner", id(ag_group): "inner",
            id(mesh.get_group("outer")): "outer"}
    return MfsdpModel(model, optimizer, axes, (param_and_grad_buffer,))
