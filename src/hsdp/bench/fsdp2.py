"""torch FSDP2 as the benchmark peer: HSDP on hsdp's mesh, with observable collectives.

FSDP2 issues its collectives through ``torch.distributed`` module attributes that it
looks up at call time (``dist.all_gather_single(...)``, ``dist.reduce_scatter_single``,
``dist.all_reduce`` in ``torch.distributed.fsdp._fully_shard._fsdp_collectives``; older
releases call ``all_gather_into_tensor`` / ``reduce_scatter_tensor``), each inside the
stream context FSDP2 chose for it. ``fsdp2_collectives`` swaps those attributes for
wrappers that, for calls on the mesh's "inner" or "outer" group:

- under emulation, first delay the current stream (CUDA) or thread (CPU) by
  ``Fabric.seconds`` of that collective, exactly as ``hsdp.comm.Collectives`` does;
- while ``tracer.enabled``, mark the call as an hsdp op so that ``hsdp.bench.trace``
  reads it like hsdp's own: ``record_function("hsdp:<stream>:<label>")`` on CUDA, and on
  CPU an ``OpRecord`` on the stream plus a compute ``wait:`` record (FSDP2's collectives
  block the calling thread on CPU: it has no streams there).

Streams and labels follow hsdp's names: inner all-gather "AG" on "ag", inner
reduce-scatter "RS" on "rs", outer all-reduce "OUTER_AR" on "outer" (FSDP2 runs these on
three different CUDA streams). Calls on any other group pass through untouched, hsdp's
own included: its runtime uses its own communicators, never the mesh's groups.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.fabric import Fabric
from hsdp.policy import MixedPrecision
from hsdp.streams import OpRecord, Tracer

# torch.distributed name -> (collective kind for Fabric, argument holding the full buffer)
WRAPPED = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
}
SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}


def shard_fsdp2(model: nn.Module, units: list[nn.Module], mesh: DeviceMesh,
                mp: MixedPrecision) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` on each unit, then on the root (HSDP on a
    2-D mesh: replicate over "outer", shard over "inner"), with ``mp``'s dtypes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


@contextmanager
def fsdp2_collectives(mesh: DeviceMesh, tracer: Tracer, fabric: Fabric | None = None,
                      sleep: Callable[[float], None] = time.sleep) -> Iterator[None]:
    """Within the block, FSDP2's collectives on ``mesh`` are delayed by ``fabric`` (if
    given, using ``sleep``: a ``hsdp.comm.SleepClock`` on CUDA) and traced into
    ``tracer``; the original ``torch.distributed`` functions are restored on exit."""
    axes = {id(mesh.get_group("inner")): "inner", id(mesh.get_group("outer")): "outer"}
    originals = {name: getattr(dist, name) for name in WRAPPED if hasattr(dist, name)}
    try:
        for name, fn in originals.items():
            kind, sized = WRAPPED[name]
            setattr(dist, name, _wrap(fn, kind, sized, axes, tracer, fabric, sleep))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _wrap(fn: Callable, kind: str, sized: str, axes: dict[int, str], tracer: Tracer,
          fabric: Fabric | None, sleep: Callable[[float], None]) -> Callable:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        axis = axes.get(id(group)) if group is not None else None
        if axis is None:
            return fn(*args, **kwargs)
        label = ("OUTER_" if axis == "outer" else "") + SHORT[kind]
        stream = "outer" if axis == "outer" else SHORT[kind].lower()
        buf = bound.arguments[sized]
        with _traced(tracer, stream, label, buf.is_cuda,
                     bool(bound.arguments.get("async_op"))):
            if fabric is not None:
                sleep(fabric.seconds(kind, axis, buf.numel() * buf.element_size(),
                                     group.size()))
            return fn(*args, **kwargs)

    return wrapper


def _traced(tracer: Tracer, stream: str, label: str, cuda: bool,
            async_op: bool) -> AbstractContextManager:
    if not tracer.enabled:
        return nullcontext()
    if cuda:
        return torch.profiler.record_function(f"hsdp:{stream}:{label}")
    if async_op:  # the call returns before the collective ends: its span says nothing
        return nullcontext()
    return _cpu_record(tracer, stream, label)


@contextmanager
def _cpu_record(tracer: Tracer, stream: str, label: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    t1 = time.perf_counter()
    tracer.add(OpRecord(stream, label, t0, t1))
    tracer.add(OpRecord("compute", f"wait:{label}", t0, t1))
