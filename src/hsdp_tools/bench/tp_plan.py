"""Tensor parallelism in the step bench: torch's TP plan for ``hsdp_tools.models``' Llama, and
the TP collectives counted and, under emulation, delayed where torch issues them.

The plan is torchtitan's Llama plan (sequence-parallel norms, no loss parallel) on this
package's block layout: one all-gather of the sequence before attention and one before the
MLP (the norms' outputs made whole), one reduce-scatter after each (``wo`` / ``w2``
rowwise into sequence shards); the backward runs the mirror images.

DTensor issues its collectives through ``torch.distributed._functional_collectives``
functions looked up at call time, on the current (compute) stream. ``tp_collectives``
swaps them for wrappers that, for calls on the tp group, count the bytes
(``"<kind>:tp"``) and, with a ``Fabric``, first sleep the collective's modelled duration
on the current stream (CUDA: a calibrated ``SleepClock``) or thread (CPU): under torch's
fake process group the collective itself does nothing. Calls on other groups pass through.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hsdp_tools.sim.fabric import Fabric

# funcol name -> collective kind (Fabric's); each takes ``self`` and ``group``
WRAPPED = {"all_gather_single": "all_gather", "all_gather_tensor": "all_gather",
           "reduce_scatter_single": "reduce_scatter",
           "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}


def apply_llama_tp_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """torch's TP plan (module docstring) on ``model``, an ``hsdp_tools.models.Llama``."""
    whole = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(use_local_output=False),
            "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(use_local_output=False),
            "w1": ColwiseParallel(), "w3": ColwiseParallel(),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        # the norms' sequence shards made whole once for all of attention / the MLP
        parallelize_module(block, tp_mesh, {"attn_norm": whole, "mlp_norm": whole})


def _group_name(group) -> str | None:
    """The process group name of funcol's ``group`` argument (None: not resolvable)."""
    if isinstance(group, tuple):
        mesh, dim = group
        return mesh.get_group(dim).group_name
    if isinstance(group, DeviceMesh):
        return group.get_group(0).group_name if group.ndim == 1 else None
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    return group if isinstance(group, str) else None


@contextmanager
def tp_collectives(tp_mesh: DeviceMesh, nbytes: dict[str, int], fabric: Fabric | None,
                   sleep: Callable[[float], None] = time.sleep) -> Iterator[None]:
    """Within the block, funcol's collectives on ``tp_mesh``'s group are counted into
    ``nbytes`` and, with ``fabric`` (its inner link: the tp link), delayed by ``sleep``."""
    name, n = tp_mesh.get_group().group_name, tp_mesh.size()
    depth = threading.local()  # funcol's deprecated names call the current ones
    saved = {f: getattr(funcol, f) for f in WRAPPED if hasattr(funcol, f)}

    def wrap(fn: Callable, kind: str) -> Callable:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            outer_call = getattr(depth, "n", 0) == 0
            if outer_call and _group_name(bound.arguments["group"]) == name:
                t: torch.Tensor = bound.arguments["self"]
                size = t.numel() * t.element_size() * (n if kind == "all_gather" else 1)
                nbytes[f"{kind}:tp"] = nbytes.get(f"{kind}:tp", 0) + size
                if fabric is not None:
                    sleep(fabric.seconds(kind, "inner", size, n))
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth.n -= 1
        return wrapper

    for f, fn in saved.items():
        setattr(funcol, f, wrap(fn, WRAPPED[f]))
    try:
        yield
    finally:
        for f, fn in saved.items():
            setattr(funcol, f, fn)
