"""Multi-rank job for tests/dist/test_torchtitan.py: torchtitan's Llama3 ``debugmodel``
(SDPA, fp32) under torchtitan's pipeline parallelism on 8 gloo ranks, pp 2 x (outer 2 x
inner 2), through torchtitan's own ``pipeline_llm`` split and schedules: hsdp's
``pipeline_llama`` (1F1B; Interleaved1F1B) against one process and torchtitan's FSDP2 +
PP path, a ``CheckpointManager`` resume, a pp 2 checkpoint resumed at pp 1, and pp 2 x tp
2 x dp 2 against one process. The training loop is torchtitan's pieces (``titan_loop``:
its optimizer container, LR schedulers, ``clip_grad_norm_`` over the pp mesh), the step
its ``pp_schedule.step``."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
from titan_cpu_configs import fsdp2_on_gloo
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as titan_dims_module
from torchtitan.distributed import utils as titan_dist
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan_jobs import (
    ROWS,
    SAVE_AT,
    SEQ,
    _batches,
    _hsdp_model,
    _loss,
    _meta_model,
    _model_config,
    _reference,
    titan_args,
    titan_loop,
)

import hsdp
from hsdp.integrations import torchtitan as hsdp_titan
from hsdp.integrations.torchtitan_pipeline import pipeline_llama

PP, MICROBATCHES = 2, 4  # microbatches of ROWS rows per DP rank and step
MAX_NORM = 0.5  # below every step's gradient norm: clipping on
DP = 4  # outer 2 x inner 2


def _named(m: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by their checkpoint names (no activation checkpointing wrapper)."""
    return {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in m.named_parameters()}


@torch.no_grad()
def _named_full(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
            for m in parts for n, p in _named(m).items()}


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in got)


def reference(dp: int = DP) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process: (initial parameters, parameters after the steps), by name, the global
    batch of every step (``dp`` ranks x MICROBATCHES) in one loop of torchtitan's pieces."""
    model = _reference()
    init = _named_full([model])
    data = _batches(dp, MICROBATCHES)

    def step_fn(step: int) -> float:
        loss = _loss(model, data[step - 1].reshape(-1, SEQ + 1), dp * MICROBATCHES * ROWS * SEQ)
        loss.backward()
        return loss.item()

    titan_loop([model], step_fn, None, False, max_norm=MAX_NORM)
    return init, _named_full([model])


def _dims(world: int, pp: int, tp: int = 1) -> ParallelDims:
    """pp x (dp_replicate 2 x dp_shard), or with ``tp`` > 1 pp x (1 x dp_shard) x tp."""
    titan_dims_module.device_type = "cpu"
    replicate = 2 if tp == 1 else 1
    dims = ParallelDims(dp_replicate=replicate, dp_shard=world // (replicate * pp * tp), cp=1,
                        tp=tp, pp=pp, ep=1, world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def _pipelined(dims: ParallelDims, schedule: str, pipelining_fn: Callable,
               parallelize_fn: Callable, init: dict[str, torch.Tensor], ac: bool,
               reshard: str) -> tuple:
    """torchtitan's PP set-up as its trainer runs it (``pipelining_fn``, ``to_empty``,
    ``init_weights``), the parameters then set to ``init``: (schedule, parts, has first
    stage, has last stage)."""
    args = titan_args(ac, reshard, training={"local_batch_size": ROWS * MICROBATCHES},
                      pipeline_parallel_degree=dims.pp, pipeline_parallel_schedule=schedule,
                      pipeline_parallel_microbatch_size=ROWS)
    out = pipelining_fn(_meta_model(), parallel_dims=dims, **args, device=torch.device("cpu"),
                        model_config=_model_config(), parallelize_fn=parallelize_fn,
                        loss_fn=CrossEntropyLoss.Config().build())
    for m in out[1]:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        mine = {n: init[n] for n in _named(m)}
        set_model_state_dict(m, mine, options=StateDictOptions(full_state_dict=True,
                                                               strict=False))
    return out


def _pp_step(schedule, has_first: bool, has_last: bool, dp_rank: int,
             dp: int = DP) -> Callable[[int], float]:
    """One step of torchtitan's ``pp_forward_backward_step`` on this DP rank's rows (of
    ``dp`` DP ranks)."""
    data = _batches(dp, MICROBATCHES)
    tokens = torch.tensor(float(dp * MICROBATCHES * ROWS * SEQ))

    def step_fn(step: int) -> float:
        seqs = data[step - 1, :, dp_rank].reshape(-1, SEQ + 1)  # split again by the schedule
        losses: list[torch.Tensor] = []
        schedule.step(*((seqs[:, :-1],) if has_first else ()),
                      target=seqs[:, 1:] if has_last else None,
                      losses=losses if has_last else None,
                      loss_kwargs={"global_valid_tokens": tokens}, return_outputs=False)
        return sum(x.item() for x in losses)

    return step_fn


def _pp1_step(model: nn.Module, rank: int, world: int) -> Callable[[int], float]:
    """The same global batches on ``world`` DP ranks without PP: each rank its share of
    the DP x MICROBATCHES row groups in one forward."""
    data = _batches(DP, MICROBATCHES)
    share = DP * MICROBATCHES // world

    def step_fn(step: int) -> float:
        groups = data[step - 1].reshape(-1, ROWS, SEQ + 1)[rank * share:(rank + 1) * share]
        loss = _loss(model, groups.reshape(-1, SEQ + 1), DP * MICROBATCHES * ROWS * SEQ)
        loss.backward()
        return loss.item()

    return step_fn


def pp_job(rank: int, world: int, root: str, init: dict[str, torch.Tensor],
           want: dict[str, torch.Tensor],
           want_tp: dict[str, torch.Tensor]) -> dict[str, float | bool]:
    """Relative parameter errors after the steps of each pp 2 configuration against one
    process (``want``) and torchtitan's FSDP2 + PP, the largest gradient norm; the
    CheckpointManager resume (bit for bit); the pp 2 checkpoint resumed on pp 1 (outer 2
    x inner 4) against the uninterrupted pp 2 run; pp 2 x tp 2 x (outer 1 x inner 2)
    against one process on the batches of 2 DP ranks (``want_tp``)."""
    dims = _dims(world, PP)
    pp_mesh, dp_rank = dims.get_mesh("pp"), rank % DP
    out: dict[str, float | bool] = {}
    full: dict[str, dict[str, torch.Tensor]] = {}
    hsdp_fn = functools.partial(hsdp_titan.parallelize_llama, strategy="hsdp",
                                overlap_outer=True)
    configs = {  # name: (schedule, pipelining_fn, parallelize_fn, ac, reshard, folder)
        "hsdp 1F1B": ("1F1B", pipeline_llama, hsdp_fn, True, "default", f"{root}/pp2"),
        "hsdp Interleaved1F1B": ("Interleaved1F1B", pipeline_llama, hsdp_fn, False, "always",
                                 None),
        "fsdp2 1F1B": ("1F1B", pipeline_llm, fsdp2_on_gloo, True, "default", None),
    }
    losses: dict[str, list[float]] = {}
    for name, (schedule, pp_fn, fn, ac, reshard, folder) in configs.items():
        sched, parts, first, last = _pipelined(dims, schedule, pp_fn, fn, init, ac, reshard)
        norms: list[float] = []
        losses[name] = titan_loop(parts, _pp_step(sched, first, last, dp_rank), folder, False,
                                  pp_mesh=pp_mesh, norms=norms, max_norm=MAX_NORM)
        full[name] = _named_full(parts)
        out[f"{name} vs ref"] = _rel(full[name], want)
        out[f"{name} max grad norm"] = max(norms)
        if "fsdp2" not in name:
            hsdp.synchronize(parts[0])
    # the same stages as FSDP2's (hfsdp under PP: tests/dist/test_pipeline.py)
    out["hsdp 1F1B vs fsdp2"] = _rel(full["hsdp 1F1B"], full["fsdp2 1F1B"])
    sched, parts, first, last = _pipelined(dims, "1F1B", pipeline_llama, hsdp_fn, init, True,
                                           "default")
    resumed = titan_loop(parts, _pp_step(sched, first, last, dp_rank), f"{root}/pp2", True,
                         pp_mesh=pp_mesh, max_norm=MAX_NORM)
    out["resume equal"] = resumed == losses["hsdp 1F1B"][SAVE_AT:] and all(
        torch.equal(t, full["hsdp 1F1B"][k]) for k, t in _named_full(parts).items())
    hsdp.synchronize(parts[0])
    model = _hsdp_model(_dims(world, 1), "hsdp")
    titan_loop([model], _pp1_step(model, rank, world), f"{root}/pp2", True, max_norm=MAX_NORM)
    pp1 = _named_full([model])
    out["pp2 ckpt -> pp1 vs pp2"] = _rel({k: pp1[k] for k in full["hsdp 1F1B"]},
                                         full["hsdp 1F1B"])
    hsdp.synchronize(model)
    out["hsdp 1F1B tp 2 vs ref"] = _pp_tp(rank, world, hsdp_fn, init, want_tp)
    return out


def _pp_tp(rank: int, world: int, parallelize_fn: Callable, init: dict[str, torch.Tensor],
           want: dict[str, torch.Tensor]) -> float:
    """pp 2 x tp 2 x (outer 1 x inner 2): torchtitan's TP plan on each stage module, then
    hsdp on the stage's 3-D mesh; the relative error against one process after the steps."""
    titan_dist.set_spmd_backend("partial_dtensor")  # the trainer's; its loss parallel needs it
    dims = _dims(world, PP, tp=2)
    sched, parts, first, last = _pipelined(dims, "1F1B", pipeline_llama, parallelize_fn, init,
                                           False, "default")
    dp_rank = rank % (world // PP) // 2  # ranks laid out (pp, dp_shard, tp)
    titan_loop(parts, _pp_step(sched, first, last, dp_rank, dp=2), None, False,
               pp_mesh=dims.get_mesh("pp"), max_norm=MAX_NORM)
    err = _rel(_named_full(parts), want)
    hsdp.synchronize(parts[0])
    return err
