"""Multi-rank jobs for post-accumulate-grad hooks and parameter writes after a step.

Each job runs many configurations of a tiny MLP (three units on a 2x2 mesh) against a
single-process reference: rank r takes rows [r*b, (r+1)*b) of each global microbatch,
its loss is the mean over its rows divided by the number of microbatches.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import hsdp
from hsdp.sharding.comm import Collectives
from hsdp.sharding.group import owner

ROWS = 2
STEPS = 3
LR, MOMENTUM = 0.1, 0.9


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                    for _ in range(2))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for blk in self.blocks:
            h = blk(h)
        return self.out(h)


def _shard(model: Net, mesh, strategy: str, overlap: bool) -> None:
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, strategy=strategy, overlap_outer=overlap)
    hsdp.fully_shard(model, mesh=mesh, strategy=strategy, overlap_outer=overlap)


def _fsdp2(model: Net, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _batch(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(world * ROWS, 6, generator=g), torch.randn(world * ROWS, 3, generator=g)


def _backward(model: nn.Module, rank: int | None, world: int, step: int, mode: str,
              kind: str) -> None:
    """One step's backward(s). mode: "plain" (one backward, no hsdp.microbatch), "mb1" /
    "mb3" (microbatches under hsdp.microbatch, or FSDP2's set_requires_all_reduce).
    kind: "ref", "hsdp" or "fsdp2"; rank None: the whole batch."""
    M = 3 if mode == "mb3" else 1
    for m in range(M):
        x, y = _batch(step, m, world)
        if rank is not None:
            x, y = x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]
        last = m == M - 1
        loss = F.mse_loss(model(x), y) / M
        if kind == "hsdp" and mode != "plain":
            with hsdp.microbatch(model, is_last=last):
                loss.backward()
        else:
            if kind == "fsdp2":
                model.set_requires_all_reduce(last, recurse=True)
            loss.backward()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _in_backward_hooks(model: nn.Module, fired: list) -> None:
    """torchtitan's optimizer-in-backward: one SGD per parameter, stepped and cleared in
    the parameter's post-accumulate-grad hook; each call records (name, the full gradient
    it saw, whether autograd was still running)."""
    for name, p in model.named_parameters():
        opt = torch.optim.SGD([p], lr=LR, momentum=MOMENTUM)

        def hook(param: torch.Tensor, name: str = name, opt=opt) -> None:
            with torch.no_grad():
                grad = _full(param.grad).clone()
            fired.append((name, grad, torch._C._current_graph_task_id() != -1))
            opt.step()
            opt.zero_grad()
        p.register_post_accumulate_grad_hook(hook)


def hooks_job(rank: int, world: int, cases: list[tuple[str, bool, str]]) -> dict:
    """For each (strategy, overlap, mode): the hooks' calls against the reference's
    gradients and final parameters; for FSDP2 (once per mode) the same, and the order in
    which hsdp and FSDP2 call the hooks."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out: dict = {}
    for strategy, overlap, mode in cases:
        torch.manual_seed(0)
        ref = Net()
        runs = {"hsdp": copy.deepcopy(ref)}
        if strategy == "hsdp" and overlap:
            runs["fsdp2"] = copy.deepcopy(ref)
        ref_grads = []
        opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
        for step in range(STEPS):
            _backward(ref, None, world, step, mode, "ref")
            ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
            opt.step()
            opt.zero_grad()
        names = [n for n, _ in ref.named_parameters()]
        for kind, model in runs.items():
            if kind == "hsdp":
                _shard(model, mesh, strategy, overlap)
            else:
                _fsdp2(model, mesh)
            fired: list = []
            _in_backward_hooks(model, fired)
            per_step = []
            for step in range(STEPS):
                before = len(fired)
                _backward(model, rank, world, step, mode, kind)
                per_step.append(fired[before:])
            final = {n: _full(p.detach()) for n, p in model.named_parameters()}
            out[(strategy, overlap, mode, kind)] = {
                "calls": [len(calls) for calls in per_step],
                "all_params_each_step": all(sorted(n for n, _, _ in calls) == sorted(names)
                                            for calls in per_step),
                "in_backward": all(b for calls in per_step for _, _, b in calls),
                "order": [[n for n, _, _ in calls] for calls in per_step],
                "grad_err": max((_rel(g, ref_grads[s][n]) for s, calls in enumerate(per_step)
                                 for n, g, _ in calls), default=float("inf")),
                "param_err": max(_rel(final[n], p.detach())
                                 for n, p in ref.named_parameters()),
            }
    return out


class SlowOuterGather(Collectives):
    """An outer all-gather that reads its input when it starts and writes its whole
    output (this rank's chunk too) when it ends, 50 ms later, as gloo's does over a
    slow link: a write into the parameters in between would be overwritten."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, axis: str) -> None:
        if axis != "outer":
            return super().all_gather(out, inp, group, axis)
        sent = inp.clone()
        time.sleep(0.05)
        super().all_gather(out, sent, group, axis)


def _writes() -> dict[str, Callable[[nn.Module, nn.Module, list], None]]:
    """Ways to write every parameter: fn(model, reference, ema) applies the same change
    to ``model`` (under no_grad); ``ema`` holds a copy of the initial parameters."""
    def params(m: nn.Module) -> list[torch.Tensor]:
        return list(m.parameters())

    def load(m: nn.Module, ref: nn.Module, _ema: list) -> None:
        if m is ref:
            for p in params(m):
                p.mul_(0.5).add_(1.0)
        else:
            m.load_state_dict(ref.state_dict())

    return {
        "in_place": lambda m, _r, _e: [p.mul_(0.5).add_(1.0) for p in params(m)],
        "copy_": lambda m, _r, _e: [p.copy_(p * 0.5 + 1.0) for p in params(m)],
        "load_state_dict": load,
        "ema_lerp": lambda m, _r, ema: torch._foreach_lerp_(params(m), ema, 0.5),
        "data": lambda m, _r, _e: [p.data.mul_(0.5) for p in params(m)],
        "to_local": lambda m, _r, _e: [(p.to_local() if hasattr(p, "to_local") else p)
                                        .mul_(0.5) for p in params(m)],
    }


def _local_err(model: nn.Module, ref: nn.Module) -> float:
    """Largest relative error of this rank's pieces against the reference's parameters,
    read as they are now (no wait for hsdp's streams)."""
    errs = []
    for p, r in zip(model.parameters(), ref.parameters()):
        group, idx = owner(p)
        q = group.params[idx]
        start, n = q.start, q.length
        errs.append(_rel(q.local, r.detach().reshape(-1)[start:start + n]))
    return max(errs)


def writes_job(rank: int, world: int, cases: list[tuple[str, str]]) -> dict:
    """For each (strategy, write): train with a parameter write after each step (even
    steps: right after optimizer.step(); odd steps: after zero_grad()), the reference
    doing the same; the errors right after each write, once hsdp's streams are idle, and
    after the last step. The outer all-gather is slowed (``SlowOuterGather``)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    writes = _writes()
    out: dict = {}
    for strategy, write in cases:
        torch.manual_seed(0)
        ref = Net()
        model = copy.deepcopy(ref)
        _shard(model, mesh, strategy, True)
        model._hsdp_unit.collectives = SlowOuterGather()
        emas = {id(m): [p.detach().clone() for p in m.parameters()] for m in (ref, model)}
        opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
                for m in (ref, model)]
        right_after, settled = [], []
        for step in range(STEPS):
            _backward(ref, None, world, step, "plain", "ref")
            _backward(model, rank, world, step, "plain", "hsdp")
            for opt in opts:
                opt.step()
            for m, opt in zip((ref, model), opts):
                if step % 2:
                    opt.zero_grad()
                with torch.no_grad():
                    writes[write](m, ref, emas[id(m)])
                if not step % 2:
                    opt.zero_grad()
            right_after.append(_local_err(model, ref))
            hsdp.synchronize(model)
            settled.append(_local_err(model, ref))
        full = hsdp.full_state_dict(model)
        out[(strategy, write)] = {
            "right_after": max(right_after), "settled": max(settled),
            "final": max(_rel(full[k], v) for k, v in ref.state_dict().items())}
    return out
