"""Checkpoints that switch the outer axis's mode on resume (exact, int8 with error
feedback, DiLoCo mid-period or at a sync) through hsdp.save / hsdp.load and torch's
get_state_dict / DCP / set_state_dict, on the same mesh and another (4 ranks, gloo)."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from diloco_jobs import _build, _state
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hsdp
from hsdp.checkpoint.extra_state import extra_state, stateful
from hsdp_tools.bench.convergence import train_steps
from hsdp_tools.bench.mode_switch import world_job

H = 4
INT8 = hsdp.OuterReduce("int8", block=16)
SOURCES = {"exact": 2, "int8": 2, "diloco_mid": 2, "diloco_sync": H}  # mode: steps before
TARGETS = ("exact", "int8", "diloco")


def _error(fn: object) -> str:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException too
        return f"{type(e).__name__}: {e}"
    return "no error"


def _model(mode: str, outer: int, inner: int, seed: int) -> nn.Module:
    sync = hsdp.DiLoCo(inner_steps=H, fragments=1, outer_lr=0.7, momentum=0.9) \
        if mode.startswith("diloco") else None
    mesh = hsdp.init_mesh(outer, inner, "cpu", outer_sync=sync)
    return _build(mesh, seed, outer_reduce=INT8 if mode == "int8" else None)


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _replica0(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, t)
    return every[0]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _describe(model: nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, object]:
    res = extra_state(model, None).get(hsdp.OuterReduce.state_key, {})
    out: dict[str, object] = {"params_replica0": _equal(_state(model), saved),
                              "residual_zero": all(not v.any() for v in res.values()),
                              "has_residual": bool(res)}
    anchors = [g.anchor for _, g, _ in stateful(model) if g.anchor is not None]
    out["diloco_fresh"] = bool(anchors) and all(a.anchor is None and a.steps == 0
                                                and a.momentum is None for a in anchors)
    return out


class Notes(logging.Handler):
    """The lines hsdp logs about a mode switch."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        logging.getLogger("hsdp.checkpoint.mode_switch").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> str:
        out, self.lines = " | ".join(self.lines), []
        return out


Case = tuple[str, str, tuple[int, int], str]  # source, target, (outer, inner), path


def every_case(world: int) -> list[Case]:
    """Every source mode into every target mode, on the same mesh and 4x1, by both paths."""
    return [(src, tgt, shape, path) for src in SOURCES for tgt in TARGETS
            for shape in ((2, world // 2), (world, 1)) for path in ("hsdp", "torch")]


def _load(path: str, how: str, model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """hsdp.load, or torch's get_state_dict / dcp.load / set_state_dict: the error."""
    if how == "hsdp":
        return _error(lambda: hsdp.load(path, model, opt))

    def torch_load() -> None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return _error(torch_load)


def switch_job(rank: int, world: int, root: str, cases: list[Case] | None = None
               ) -> dict[str, object]:
    """Each case: a checkpoint of the source mode (saved by hsdp.save and by DCP) loaded
    into a model of the target mode: the error, whether the parameters are replica 0's,
    the residuals and DiLoCo state after it, the note logged, one more step finite."""
    cases = every_case(world) if cases is None else cases
    out: dict[str, object] = {}
    notes = Notes()
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for src in dict.fromkeys(c[0] for c in cases):
        m = _model(src, 2, world // 2, 0)
        o = _opt(m)
        train_steps(m, o, range(SOURCES[src]))
        saved[src] = _replica0(_state(m))
        hsdp.save(os.path.join(root, f"{src}-hsdp"), m, o)
        msd, osd = get_state_dict(m, o)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"{src}-torch"))
    notes.take()
    for src, tgt, shape, how in cases:
        t = _model(tgt, *shape, 7)
        opt = _opt(t)
        err = _load(os.path.join(root, f"{src}-{how}"), how, t, opt)
        got = {"error": err[:300], **_describe(t, saved[src]), "note": notes.take()}
        train_steps(t, opt, range(SOURCES[src], SOURCES[src] + 1))
        got["finite"] = all(v.isfinite().all().item() for v in _state(t).values())
        out[f"{src}->{tgt}@{shape[0]}x{shape[1]}/{how}"] = got
    return out


def expected(case: str) -> dict[str, object]:
    """The documented rule (docs/guide/checkpoints.md) for ``case``
    ("src->tgt@OxI/path"): what the model holds after the load, what the note says."""
    src, rest = case.split("->")
    tgt, rest = rest.split("@")
    shape, how = rest.split("/")
    same = shape == "2x2"
    res_in, sync_in = src == "int8", src.startswith("diloco")
    res_kept = res_in and tgt == "int8" and (same or how == "hsdp")
    sync_kept = sync_in and tgt == "diloco" and same
    parts = [res_in and tgt != "int8" and "residuals are dropped",
             sync_in and tgt != "diloco" and "DiLoCo state is dropped",
             tgt == "int8" and not res_kept and "residuals start from zero",
             tgt == "diloco" and not sync_kept and "DiLoCo starts afresh"]
    return {"residual_zero": not res_kept, "diloco_fresh": tgt == "diloco" and not sync_kept,
            "note": [p for p in parts if p]}


def check(results: list[dict[str, object]]) -> None:
    for case, got in results[0].items():
        want = expected(case)
        assert got["error"] == "no error" and got["params_replica0"] and got["finite"], (
            case, got)
        assert got["residual_zero"] == want["residual_zero"], (case, got)
        assert got["diloco_fresh"] == want["diloco_fresh"], (case, got)
        for part in want["note"]:
            assert part in got["note"], (case, part, got["note"])
        assert bool(got["note"]) == bool(want["note"]), (case, got["note"])
    for r in results[1:]:  # the note is rank 0's alone
        assert all(not got["note"] for got in r.values()), r


def converge_job(rank: int, world: int, root: str, steps: int) -> dict[str, list[float]]:
    """hsdp_tools.bench.mode_switch's runs, short: seeds 0 and 1, exact and switched
    (exact -> int8 -> DiLoCo H=10 -> exact across three resumes), 8 ranks (4x2)."""
    return world_job(rank, world, [0, 1], steps, root)
