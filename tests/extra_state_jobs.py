"""hsdp's training state beyond parameters and optimizer state (the compressed outer
reduction's error-feedback residual, DiLoCo's anchors, momentum, clocks and each replica's
own values between syncs) through torch's state-dict API and DCP, and across layouts
(4 ranks, 2x2 gloo)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from diloco_jobs import _build as _diloco_build
from diloco_jobs import _error
from outer_reduce_jobs import INT8, _build, _residual_state, _state, _train
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import hsdp
from hsdp_tools.bench.convergence import train_steps

K = 2  # int8: steps before the save, and again after the load
DK, H = 5, 3  # DiLoCo: steps before the save (mid-period), and the period


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _torch_save(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _torch_load(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _int8_torch(rank: int, world: int, root: str) -> dict[str, object]:
    """int8 with error feedback, saved and resumed by torch's get_state_dict / DCP /
    set_state_dict (and its flattened optimizer state dict): the uninterrupted run's
    parameters and residuals, bit for bit?"""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out: dict[str, object] = {}
    models = [_build(mesh, "hsdp", seed) for seed in (0, 1)]
    opts = [_adamw(m) for m in models]
    _train(models[0], opts[0], rank, world, range(K))
    path = os.path.join(root, "int8-torch")
    _torch_save(path, models[0], opts[0])
    flat = get_optimizer_state_dict(models[0], opts[0], options=StateDictOptions(
        flatten_optimizer_state_dict=True))
    out["flat_has_residual"] = any(k.startswith("hsdp_outer_residual.") for k in flat)
    out["full_error"] = _error(lambda: get_optimizer_state_dict(
        models[0], opts[0], options=StateDictOptions(full_state_dict=True)))
    _train(models[0], opts[0], rank, world, range(K, 2 * K))
    _torch_load(path, models[1], opts[1])
    _train(models[1], opts[1], rank, world, range(K, 2 * K))
    out["resumed_equal"] = _equal(_state(models[0]), _state(models[1]))
    out["residual_equal"] = _equal(_residual_state(models[0]), _residual_state(models[1]))
    # a residual of another layout in the dict: a clear error, nothing changed
    osd = get_optimizer_state_dict(models[1], opts[1])
    key = sorted(osd["hsdp_outer_residual"])[0]
    osd["hsdp_outer_residual"][key] = torch.zeros(3)
    before = _residual_state(models[1]), {k: v.clone() for k, v in opts[1].state_dict()[
        "state"][0].items()}
    out["bad_error"] = _error(lambda: set_optimizer_state_dict(models[1], opts[1], osd))
    out["bad_unchanged"] = (_equal(before[0], _residual_state(models[1]))
                            and _equal(before[1], opts[1].state_dict()["state"][0]))
    return out


def _diloco_torch(rank: int, world: int, root: str) -> dict[str, object]:
    """DiLoCo saved mid-period by torch's get_state_dict / DCP and resumed by
    set_state_dict: bit for bit the uninterrupted run?"""
    cfg = hsdp.DiLoCo(inner_steps=H, fragments=1, outer_lr=0.7, momentum=0.9)
    mesh = hsdp.init_mesh(2, world // 2, "cpu", outer_sync=cfg)
    models = [_diloco_build(mesh, seed) for seed in (0, 1)]
    opts = [_adamw(m) for m in models]
    train_steps(models[0], opts[0], range(DK))
    path = os.path.join(root, "diloco-torch")
    _torch_save(path, models[0], opts[0])
    train_steps(models[0], opts[0], range(DK, DK + H + 1))
    _torch_load(path, models[1], opts[1])
    train_steps(models[1], opts[1], range(DK, DK + H + 1))
    return {"resumed_equal": _equal(_state(models[0]), _state(models[1]))}


def torch_api_job(rank: int, world: int, root: str) -> dict[str, object]:
    return {"int8": _int8_torch(rank, world, root), "diloco": _diloco_torch(rank, world, root)}


def _replicas(t: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Each rank's ``t`` (full tensors), gathered."""
    every: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, t)
    return every


def mid_period_job(rank: int, world: int, root: str) -> dict[str, object]:
    """A DiLoCo checkpoint saved mid-period (replicas differ), loaded without the optimizer
    into a DiLoCo run and into a synchronous run, by hsdp.load and by torch's DCP: every
    rank gets replica 0's parameters (outer rank 0's)?"""
    cfg = hsdp.DiLoCo(inner_steps=4, fragments=1, outer_lr=0.7)
    outer, inner = 2, world // 2
    mesh = hsdp.init_mesh(outer, inner, "cpu", outer_sync=cfg)
    model = _diloco_build(mesh, 0)
    opt = _adamw(model)
    train_steps(model, opt, range(2))
    saved = _replicas(_state(model))
    hsdp.save(os.path.join(root, "mid-hsdp"), model, opt)
    _torch_save(os.path.join(root, "mid-torch"), model, opt)
    out: dict[str, object] = {"replicas_differ": not _equal(saved[0], saved[inner])}
    for target, sync in (("diloco", cfg), ("sync", None)):
        m = _diloco_build(hsdp.init_mesh(outer, inner, "cpu", outer_sync=sync), 5)
        hsdp.load(os.path.join(root, "mid-hsdp"), m)
        out[f"hsdp->{target}"] = _equal(_state(m), saved[0])
        m = _diloco_build(hsdp.init_mesh(outer, inner, "cpu", outer_sync=sync), 6)
        msd = m.state_dict()
        dcp.load({"model": msd}, checkpoint_id=os.path.join(root, "mid-torch"))
        m.load_state_dict(msd)
        out[f"torch->{target}"] = _equal(_state(m), saved[0])
    return out


def _all_or_nothing(path: str, model: nn.Module, opt: torch.optim.Optimizer
                    ) -> tuple[str, bool]:
    """hsdp.load's error (or "no error") and whether the model, optimizer and residuals
    are unchanged after it."""
    before = (_state(model), {k: v.clone() for k, v in _residual_state(model).items()},
              {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()})
    error = _error(lambda: hsdp.load(path, model, opt))
    after = (_state(model), _residual_state(model),
             {id(p): st for p, st in opt.state.items()})
    same = (_equal(before[0], after[0]) and _equal(before[1], after[1])
            and before[2].keys() == after[2].keys()
            and all(_equal(before[2][k], after[2][k]) for k in before[2]))
    return error, same


def _outer_mean(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per group, the mean over the outer ranks of every rank's residual, laid at its inner
    shard's positions of the group's flat buffer (what a conversion keeps)."""
    out: dict[str, torch.Tensor] = {}
    for per_rank in _replicas(_residual_state(model)):
        for key, t in per_rank.items():
            group, _, where = key.partition("@")
            sizes, _, coords = where.partition(":")
            outer, i = int(sizes.split("x")[0]), int(coords.split("-")[1])
            acc = out.setdefault(group, torch.zeros(4 * t.numel()))
            acc[i * t.numel():(i + 1) * t.numel()] += t / outer
    return out


def _same_mean(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    def close(x: torch.Tensor, y: torch.Tensor) -> bool:
        n = min(x.numel(), y.numel())
        return (torch.allclose(x[:n], y[:n], rtol=1e-5, atol=1e-9)
                and not x[n:].any() and not y[n:].any())
    return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)


def layouts_job(rank: int, world: int, root: str) -> dict[str, object]:
    """An hsdp int8 checkpoint loaded into other layouts: hfsdp int8, another block size,
    fp8, another mesh. Each: the error (or none), the model, optimizer and residual
    unchanged on error, the next step's parameters finite and (where converted) the
    residuals' mean over the outer ranks at each position kept."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    src = _build(mesh, "hsdp", 0)
    opt = _adamw(src)
    _train(src, opt, rank, world, range(K))
    path = os.path.join(root, "int8-hsdp")
    hsdp.save(path, src, opt)
    saved = _outer_mean(src)
    out: dict[str, object] = {}
    cases = {"hfsdp": (mesh, "hfsdp", INT8), "block32": (mesh, "hsdp", hsdp.OuterReduce(
        "int8", block=32)), "fp8": (mesh, "hsdp", hsdp.OuterReduce("fp8_e4m3", block=16)),
        "4x1": (hsdp.init_mesh(world, 1, "cpu"), "hsdp", INT8)}
    for name, (m_mesh, strategy, reduce) in cases.items():
        m = _build(m_mesh, strategy, 3, outer_reduce=reduce)
        o = _adamw(m)
        _train(m, o, rank, world, range(1))  # live state an error must leave alone
        error, same = _all_or_nothing(path, m, o)
        kept = error != "no error" or _same_mean(saved, _outer_mean(m))
        _train(m, o, rank, world, range(K, K + 1))
        finite = all(v.isfinite().all().item() for v in _state(m).values())
        out[name] = {"error": error, "unchanged": same, "finite": finite, "kept": kept}
    return out

