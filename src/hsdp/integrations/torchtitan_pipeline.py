"""hsdp under torchtitan's (0.3.0) pipeline parallelism: ``pipeline_llama``, the model
spec's ``pipelining_fn`` that ``hsdp.integrations.torchtitan.with_hsdp`` sets.

torchtitan's ``pipeline_llm`` splits the meta-built model into stage modules, builds a
torch ``PipelineStage`` for each and calls the spec's ``parallelize_fn`` on each stage
module. ``pipeline_llama`` runs it with hsdp's ``parallelize_llama`` given the mesh of
this rank's stage (its (outer, inner[, tp]) ranks, cut from one mesh over the world
built here on every rank), then makes each stage hsdp's ``PipelineStage``
(``hsdp.pipelining``): each stage's outer reduction runs once per step, after its last
microbatch's backward. Schedules whose backward is split into input and weight parts
(zero-bubble, DualPipeV) and CSV schedules are refused before anything is split.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torchtitan.config import ParallelismConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import pipeline_llm

from hsdp.pipelining import PipelineStage

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
SPLIT_BACKWARD_SCHEDULES = ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV")


def check_pipeline(parallelism: ParallelismConfig) -> None:
    """Refuse a pipeline schedule hsdp cannot drive, naming it and the ones it can."""
    name = parallelism.pipeline_parallel_schedule
    if parallelism.pipeline_parallel_schedule_csv:
        raise ValueError(f"hsdp's torchtitan integration does not run CSV pipeline schedules "
                         f"(--parallelism.pipeline_parallel_schedule_csv); use "
                         f"--parallelism.pipeline_parallel_schedule with one of {SCHEDULES}")
    if name.lower() in (s.lower() for s in SCHEDULES):
        return
    why = (" (it splits each backward into input and weight parts; hsdp reduces a unit's "
           "gradients from its backward hooks)"
           if name.lower() in (s.lower() for s in SPLIT_BACKWARD_SCHEDULES) else "")
    raise ValueError(f"hsdp's torchtitan integration does not support the pipeline schedule "
                     f"{name!r}{why}; use one of {SCHEDULES}")


def stage_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """hsdp's mesh of this rank's stage, ("outer", "inner"[, "tp"]) = (dp_replicate,
    dp_shard[, tp]), cut from a ("pp", ...) mesh over the world laid out as torchtitan's
    (pp slowest, tp fastest). Every rank of the world calls it (it makes groups)."""
    names = ("outer", "inner", *(("tp",) if parallel_dims.tp_enabled else ()))
    sizes = (parallel_dims.dp_replicate, parallel_dims.dp_shard,
             *((parallel_dims.tp,) if parallel_dims.tp_enabled else ()))
    world = init_device_mesh(parallel_dims.world_mesh.device_type, (parallel_dims.pp, *sizes),
                             mesh_dim_names=("pp", *names))
    return world[names]


def pipeline_llama(model: nn.Module, *, parallel_dims: ParallelDims,
                   parallelism: ParallelismConfig, parallelize_fn: Any,
                   **kwargs: Any) -> tuple[_PipelineSchedule, list[nn.Module], bool, bool]:
    """torchtitan's ``pipeline_llm`` (same arguments and result) with hsdp stages."""
    check_pipeline(parallelism)
    if parallel_dims.cp_enabled or parallel_dims.ep_enabled:
        raise ValueError("hsdp's torchtitan integration does not support "
                         "context_parallel_degree > 1 or expert_parallel_degree > 1")
    mesh = stage_mesh(parallel_dims)
    schedule, parts, has_first, has_last = pipeline_llm(
        model, parallel_dims=parallel_dims, parallelism=parallelism,
        parallelize_fn=functools.partial(parallelize_fn, mesh=mesh), **kwargs)
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        PipelineStage.adopt(stage)
    return schedule, parts, has_first, has_last
