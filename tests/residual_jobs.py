"""Multi-rank jobs of the compressed outer reduction's residual around steps whose
gradients never reach the optimizer: a non-finite (or huge) gradient on one rank at one
step that the loop skips, gradients cleared without a step, a save after such a step.

Each run is a plan of microbatches over a GPT (2x2 mesh); the run with a bad step is
compared with the run in which that step never happened (its microbatch not run at all):
the residual must be the same, so the later norms and parameters are bit for bit equal."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from parity_jobs import ROWS_PER_RANK, _batches

import hsdp
from hsdp.checkpoint.extra_state import extra_state
from hsdp_tools.models import GPT, GPTConfig, lm_loss

BLOCK = 16
FORMATS = {"int8": hsdp.OuterReduce("int8", block=BLOCK),
           "fp8_e4m3": hsdp.OuterReduce("fp8_e4m3", block=BLOCK), "exact": None}


def _build(mesh: object, strategy: str, outer_reduce: hsdp.OuterReduce | None) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, strategy=strategy, outer_reduce=outer_reduce)
    return hsdp.fully_shard(model, mesh=mesh, strategy=strategy, outer_reduce=outer_reduce)


def _poison(model: nn.Module, value: float) -> torch.utils.hooks.RemovableHandle:
    """One element of the first block's output gradient set to ``value`` (this rank's
    backward only): a bad sample's NaN, inf or outlier entering the weights' gradients."""
    def forward_hook(_module: nn.Module, _args: object, out: torch.Tensor) -> None:
        def grad_hook(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g.view(-1)[5] = value
            return g
        out.register_hook(grad_hook)
    return model.blocks[0].register_forward_hook(forward_hook)


def _backward(model: nn.Module, rank: int, world: int, data: int, bad: float | None) -> None:
    cfg = GPTConfig()
    tokens = _batches(data, 0, world, cfg)[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
    handle = _poison(model, bad) if bad is not None and rank == 0 else None
    try:
        lm_loss(model(tokens), tokens).backward()
    finally:
        if handle is not None:
            handle.remove()


def run_plan(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int,
             plan: list[tuple]) -> list[float]:
    """Run ``plan``: ("step", data, bad) a backward (``bad``: the poisoned value on rank 0,
    or None), the total norm, then the usual loop: a finite norm steps, a non-finite one is
    skipped, and the gradients are cleared either way; ("backward", data) a backward
    accumulated into the gradients; ("zero", set_to_none) ``opt.zero_grad``. Returns the
    norms of the "step" items."""
    norms = []
    for item in plan:
        if item[0] == "zero":
            opt.zero_grad(set_to_none=item[1])
            continue
        _backward(model, rank, world, item[1], item[2] if item[0] == "step" else None)
        if item[0] == "step":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6).item()
            norms.append(norm)
            if math.isfinite(norm):
                opt.step()
            opt.zero_grad()
    return norms


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in hsdp.full_state_dict(model).items()}


def _residuals(model: nn.Module) -> dict[str, torch.Tensor]:
    state = extra_state(model, None).get(hsdp.OuterReduce.state_key, {})
    return {k: v.clone() for k, v in state.items()}


def _compare(mesh: object, rank: int, world: int, strategy: str, fmt: str,
             plan: list[tuple], reference: list[tuple]) -> dict[str, object]:
    """Run ``plan`` and ``reference`` on fresh models; what matches."""
    runs = []
    for p in (plan, reference):
        model = _build(mesh, strategy, FORMATS[fmt])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        norms = run_plan(model, opt, rank, world, p)
        runs.append((norms, _state(model), _residuals(model)))
    (norms, a, ra), (ref_norms, b, rb) = runs
    tail = len(ref_norms) - 2  # the reference's last two steps: after the bad one
    return {
        "later_norms_equal": norms[-2:] == ref_norms[tail:],
        "later_norms_finite": all(math.isfinite(n) for n in norms[-2:]),
        "params_equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
        "residuals_equal": ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k])
                                                          for k in ra),
    }


CLEAN = [("step", 0, None)]
AFTER = [("step", 3, None), ("step", 4, None)]


def skipped_step_job(rank: int, world: int) -> dict[str, dict[str, object]]:
    """A bad value on rank 0 at step 2, which the loop skips (non-finite norm), against
    the run without step 2, per format, strategy and value; and the bad step's own norm."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out = {}
    cases = [("int8", "hsdp", math.nan), ("fp8_e4m3", "hsdp", math.nan),
             ("int8", "hsdp", math.inf), ("int8", "hfsdp", math.nan),
             ("int8", "hsdp", 1e30), ("fp8_e4m3", "hfsdp", 1e30), ("exact", "hsdp", math.nan)]
    for fmt, strategy, bad in cases:
        r = _compare(mesh, rank, world, strategy, fmt, [*CLEAN, ("step", 2, bad), *AFTER],
                     [*CLEAN, *AFTER])
        out[f"{fmt}-{strategy}-{bad}"] = r
    return out


def cleared_job(rank: int, world: int) -> dict[str, dict[str, object]]:
    """Gradients cleared without a step: a backward, ``zero_grad`` (both kinds), then two
    accumulated backwards and a step, against the run without the first backward."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out = {}
    for set_to_none in (True, False):
        for strategy in ("hsdp", "hfsdp"):
            plan = [*CLEAN, ("backward", 2), ("zero", set_to_none), ("backward", 5),
                    ("step", 6, None), *AFTER]
            reference = [*CLEAN, ("backward", 5), ("step", 6, None), *AFTER]
            out[f"{strategy}-{set_to_none}"] = _compare(mesh, rank, world, strategy, "int8",
                                                        plan, reference)
    return out


def save_job(rank: int, world: int, root: str) -> dict[str, object]:
    """A NaN step skipped, then saved: the saved residuals are finite and those of before
    the bad step, and the loaded model's next norm is finite; a NaN step the loop steps
    anyway (its NaNs zeroed): the residual stays finite, and so does the next norm."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out: dict[str, object] = {}
    for fmt in ("int8", "fp8_e4m3"):
        model = _build(mesh, "hsdp", FORMATS[fmt])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run_plan(model, opt, rank, world, CLEAN)
        before = _residuals(model)
        run_plan(model, opt, rank, world, [("step", 2, math.nan)])
        path = os.path.join(root, fmt)
        hsdp.save(path, model, opt)
        other = _build(mesh, "hsdp", FORMATS[fmt])
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        hsdp.load(path, other, other_opt)
        loaded = _residuals(other)
        out[f"{fmt}-saved"] = {
            "finite": all(bool(v.isfinite().all()) for v in loaded.values()),
            "unchanged": before.keys() == loaded.keys() and all(
                torch.equal(before[k], loaded[k]) for k in before),
            "next_norm_finite": math.isfinite(
                run_plan(other, other_opt, rank, world, [("step", 3, None)])[0]),
        }
        # stepped anyway, the NaNs replaced by zeros first (a loop that repairs them)
        model = _build(mesh, "hsdp", FORMATS[fmt])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run_plan(model, opt, rank, world, CLEAN)
        _backward(model, rank, world, 2, math.nan)
        for p in model.parameters():
            p.grad.nan_to_num_(0.0, 0.0, 0.0)
        opt.step()
        opt.zero_grad()
        norm = run_plan(model, opt, rank, world, [("step", 3, None)])[0]
        out[f"{fmt}-stepped"] = {
            "finite": all(bool(v.isfinite().all()) for v in _residuals(model).values()),
            "next_norm_finite": math.isfinite(norm)}
    # a 1e30 outlier stepped anyway (clip_grad_norm_ alone scales the gradients to zero)
    model = _build(mesh, "hsdp", FORMATS["int8"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_plan(model, opt, rank, world, CLEAN)
    _backward(model, rank, world, 2, 1e30)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    out["outlier-stepped-largest"] = max(v.abs().max().item()
                                         for v in _residuals(model).values())
    return out


def _groups(model: nn.Module) -> list:
    return [g for m in model.modules() if "_hsdp_unit" in vars(m)
            for g in m._hsdp_unit.groups]


def _residual_rows(g: object) -> torch.Tensor:
    """The mean over the outer ranks of group ``g``'s committed residuals, at the
    positions of this rank's reduced gradient (hsdp: the inner shard; hfsdp: its row)."""
    mean = g.compressed.residual_flat()
    dist.all_reduce(mean, group=g.comms.host_outer)  # not the outer stream's
    mean /= g.comms.outer_size
    if not g.shard_outer:
        return mean
    return g.compressed.rows.split(mean)[g.comms.outer_rank]


def accumulation_job(rank: int, world: int) -> dict[str, float]:
    """Error feedback telescopes over a step's accumulated backwards: after a step, each
    reduced gradient plus the outer mean of the new residual is the exact reduction's
    gradient plus the outer mean of the residual the step started from (what each
    quantization dropped re-enters once). A step 0, then a backward cleared by zero_grad
    without a step (its residual discarded), two backwards accumulated, a step; SGD with
    lr 0 keeps the parameters of the compressed and the exact run equal. Per strategy:
    the largest violation relative to the largest gradient, and the residual's size
    relative to it (what double counting it would add)."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out = {}
    for strategy in ("hsdp", "hfsdp"):
        sides = []
        for fmt in ("int8", "exact"):
            model = _build(mesh, strategy, FORMATS[fmt])
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            run_plan(model, opt, rank, world, CLEAN)
            hsdp.synchronize(model)
            start = [_residual_rows(g) for g in _groups(model)] if fmt == "int8" else None
            run_plan(model, opt, rank, world, [("backward", 1), ("zero", True)])
            _backward(model, rank, world, 2, None)
            _backward(model, rank, world, 3, None)
            opt.step()
            hsdp.synchronize(model)
            grads = [g.grads.grad_buf.clone() for g in _groups(model)]
            end = [_residual_rows(g) for g in _groups(model)] if fmt == "int8" else None
            sides.append((grads, start, end))
        (grads, start, end), (exact, _, _) = sides
        scale = max(e.abs().max().item() for e in exact)
        out[strategy] = (
            max(((q + r1 - e - r0).abs().max().item()
                 for q, r1, e, r0 in zip(grads, end, exact, start))) / scale,
            max(r0.abs().max().item() for r0 in start) / scale)
    return out
