"""Multi-rank jobs of DiLoCo on the outer axis (``init_mesh(outer_sync=hsdp.DiLoCo(...))``):
equivalence with synchronous hsdp, the outer traffic, checkpoints, bad settings."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

import hsdp
from hsdp.checkpoint.extra_state import apply
from hsdp.sharding.comm import Collectives
from hsdp_tools.bench.convergence import MODEL, ROWS_PER_RANK, _batch, train_steps
from hsdp_tools.models import build_model, lm_loss

LR = 0.05


class CountOuter(Collectives):
    """Counts the collectives over the outer axis."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = 0

    def before(self, kind: str, axis: str, nbytes: int, group_size: int) -> None:
        self.outer += axis == "outer"


def _build(mesh: object, seed: int = 0, strategy: str = "hsdp", **kw: object) -> nn.Module:
    torch.manual_seed(seed)
    model = build_model(MODEL)
    for block in model.blocks:  # units: each block, the root
        hsdp.fully_shard(block, mesh=mesh, strategy=strategy, **kw)
    return hsdp.fully_shard(model, mesh=mesh, strategy=strategy, **kw)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in hsdp.full_state_dict(model).items()}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in a)


def _differs_over_outer(model: nn.Module, outer: int, inner: int) -> bool:
    """Whether the outer replicas hold different parameters."""
    flat = torch.cat([v.reshape(-1).float() for v in _state(model).values()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return any(not torch.equal(every[0], every[o * inner]) for o in range(outer))


def equivalence_job(rank: int, world: int, steps: int = 6) -> dict[str, object]:
    """H=1, outer_lr=1, momentum=0, plain SGD inside: the relative error to synchronous
    hsdp after ``steps`` steps (F=1 and F=3: every fragment syncs every step), and the
    outer collectives each issued."""
    outer, inner = 4, world // 4
    sync = _build(hsdp.init_mesh(outer, inner, "cpu"))
    ref_opt = torch.optim.SGD(sync.parameters(), lr=LR)
    train_steps(sync, ref_opt, range(steps))
    ref = _state(sync)
    out: dict[str, object] = {}
    for name, fragments, quant in (("F1", 1, None), ("F3", 3, None), ("int8", 1, "int8:64")):
        cfg = hsdp.DiLoCo(inner_steps=1, fragments=fragments, outer_lr=1.0, momentum=0.0)
        model = _build(hsdp.init_mesh(outer, inner, "cpu", outer_sync=cfg), outer_reduce=quant)
        counter = model._hsdp_unit.collectives = CountOuter()
        train_steps(model, torch.optim.SGD(model.parameters(), lr=LR), range(steps))
        groups = len(model._hsdp_unit.runtime.outer.groups)
        out[name] = {"rel": _rel(_state(model), ref),
                     "outer_per_group_step": counter.outer / (groups * steps)}
    return out


def h10_job(rank: int, world: int, steps: int = 30) -> dict[str, object]:
    """H=10 (F=1, F=3, F=1 with delay 2), AdamW inside, Nesterov outside, beside
    synchronous hsdp with the same inner optimizer: the losses, the outer collectives,
    whether the replicas differ in the middle of a period and agree right after the sync
    step (F=1: step 30; with delay 2, step 32 and not before)."""
    outer, inner = 4, world // 4
    sync = _build(hsdp.init_mesh(outer, inner, "cpu"))
    out: dict[str, object] = {"sync": train_steps(sync, torch.optim.AdamW(sync.parameters(),
                                                                     lr=3e-3), range(steps))}
    for name, fragments, delay in (("F1", 1, 0), ("F3", 3, 0), ("F1d2", 1, 2)):
        cfg = hsdp.DiLoCo(inner_steps=10, fragments=fragments, outer_lr=0.7, momentum=0.9,
                          delay=delay)
        model = _build(hsdp.init_mesh(outer, inner, "cpu", outer_sync=cfg))
        counter = model._hsdp_unit.collectives = CountOuter()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = train_steps(model, opt, range(steps - 5))
        synced = not _differs_over_outer(model, outer, inner)  # after step 25: mid-period
        losses += train_steps(model, opt, range(steps - 5, steps))
        hsdp.synchronize(model)  # with delay, the last all-reduce may still be in flight
        groups = len(model._hsdp_unit.runtime.outer.groups)
        out[name] = {"losses": losses, "outer_per_group": counter.outer / groups,
                     "mid_period_differs": not synced,
                     "synced_at_end": not _differs_over_outer(model, outer, inner)}
        if delay:
            train_steps(model, opt, range(steps, steps + delay))
            out[name]["synced_after_delay"] = not _differs_over_outer(model, outer, inner)
    return out


CLIP = 0.5  # below every replica's gradient norm in compose_job's steps


def compose_job(rank: int, world: int, steps: int = 4) -> dict[str, float]:
    """DiLoCo at H=1, outer_lr=1, momentum=0 with plain SGD composed with what a training
    loop adds: fp8 pseudo-gradients (to synchronous hsdp: close, not exact), 2 microbatches
    and bf16 parameters (to synchronous hsdp with the same), ``hsdp.clip_grad_norm_``
    (each replica clips its own gradient: to one process averaging the replicas' clipped
    SGD updates). The relative parameter errors, and the smallest replica norm clipped."""
    outer, inner = 4, world // 4
    bf16 = hsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = hsdp.DiLoCo(inner_steps=1, outer_lr=1.0, momentum=0.0)
    out: dict[str, float] = {}
    for name, kw, micro in (("fp8", {}, 1), ("mb2", {}, 2), ("bf16", {"mp_policy": bf16}, 1)):
        runs = []
        for outer_sync in (None, cfg):
            quant = "fp8_e4m3:64" if name == "fp8" and outer_sync else None
            model = _build(hsdp.init_mesh(outer, inner, "cpu", outer_sync=outer_sync),
                           outer_reduce=quant, **kw)
            train_steps(model, torch.optim.SGD(model.parameters(), lr=LR), range(steps),
                        microbatches=micro)
            runs.append(_state(model))
        out[name] = _rel(runs[1], runs[0])
    model = _build(hsdp.init_mesh(outer, inner, "cpu", outer_sync=cfg))
    train_steps(model, torch.optim.SGD(model.parameters(), lr=LR), range(steps),
                max_norm=CLIP)
    want, out["min_norm"] = _replicas_clipped_sgd(outer, inner, steps)
    out["clip"] = _rel(_state(model), want)
    return out


def _replicas_clipped_sgd(outer: int, inner: int, steps: int
                          ) -> tuple[dict[str, torch.Tensor], float]:
    """One process: each step, every replica's gradient (mean over its ranks' rows),
    clipped to ``CLIP``, its SGD updates averaged. The parameters and the smallest norm."""
    torch.manual_seed(0)
    model = build_model(MODEL)
    params, rows, norms = list(model.parameters()), ROWS_PER_RANK, []
    for step in range(steps):
        batch = _batch(step, 0, outer * inner * rows)
        updates = []
        for o in range(outer):
            model.zero_grad()
            for r in range(o * inner, (o + 1) * inner):
                tokens = batch[r * rows:(r + 1) * rows]
                (lm_loss(model(tokens), tokens) / inner).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
            updates.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                p.sub_(torch.stack([u[i] for u in updates]).mean(0), alpha=LR)
    return {k: v.detach() for k, v in model.state_dict().items()}, min(norms)


K, H = 7, 3  # steps before the save (mid-period), and after; the period


def resume_job(rank: int, world: int, root: str) -> dict[str, object]:
    """Train K steps, save, train K more; a differently seeded model loads the checkpoint
    and trains the same K steps: the same parameters, bit for bit? A control that loads
    the checkpoint but starts its anchors afresh: does it differ?"""
    # delay 1: fragment 0 (synced after steps 1, 4, 7) has its step-7 all-reduce pending
    cfg = hsdp.DiLoCo(inner_steps=H, fragments=3, outer_lr=0.7, momentum=0.9, delay=1)
    mesh = hsdp.init_mesh(4, world // 4, "cpu", outer_sync=cfg)
    path = os.path.join(root, "diloco")
    models = [_build(mesh, seed) for seed in (0, 1, 2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    train_steps(models[0], opts[0], range(K))
    hsdp.save(path, models[0], opts[0])
    train_steps(models[0], opts[0], range(K, 2 * K))
    for m, opt in zip(models[1:], opts[1:]):
        hsdp.load(path, m, opt)
    apply(models[2], {}, None)  # the control: anchors from the loaded parameters
    for m, opt in zip(models[1:], opts[1:]):
        train_steps(m, opt, range(K, 2 * K))
    a, b, c = (_state(m) for m in models)
    return {"resumed_equal": all(torch.equal(a[k], b[k]) for k in a),
            "control_differs": any(not torch.equal(a[k], c[k]) for k in a)}


def _error(fn: object) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def _async_manager() -> object:
    """A torchft Manager as made by hand with its default asynchronous quorum (its
    setting alone: init_mesh refuses it before using it)."""
    import torchft

    manager = torchft.Manager.__new__(torchft.Manager)
    manager._use_async_quorum = True  # torchft 0.2.0's attribute
    return manager


def errors_job(rank: int, world: int) -> dict[str, str]:
    """Bad settings: each refused (the message), and nothing changed (the parameters, the
    optimizer state)."""
    out = {name: _error(fn) for name, fn in {
        "H0": lambda: hsdp.DiLoCo(inner_steps=0),
        "F0": lambda: hsdp.DiLoCo(fragments=0),
        "lr": lambda: hsdp.DiLoCo(outer_lr=0.0),
        "momentum": lambda: hsdp.DiLoCo(momentum=1.0),
        "delay": lambda: hsdp.DiLoCo(inner_steps=4, delay=4),
        "type": lambda: hsdp.init_mesh(4, world // 4, "cpu", outer_sync="diloco"),
        "ft_delay": lambda: hsdp.init_mesh(
            4, world // 4, "cpu", fault_tolerance=hsdp.FaultTolerance(),
            outer_sync=hsdp.DiLoCo(inner_steps=4, fragments=2, delay=3)),
        "ft_async": lambda: hsdp.init_mesh(4, world // 4, "cpu", outer_sync=hsdp.DiLoCo(),
                                           fault_tolerance=_async_manager()),
    }.items()}
    mesh = hsdp.init_mesh(4, world // 4, "cpu", outer_sync=hsdp.DiLoCo(10, fragments=2))
    out["hfsdp"] = _error(lambda: _build(mesh, strategy="hfsdp"))
    tokens = _batch(0, 0, ROWS_PER_RANK)
    model = _build(mesh)  # 3 units: 2 fragments do not divide them
    before = _state(model)
    out["fragments"] = _error(lambda: model(tokens))
    out["fragments_unchanged"] = str(all(torch.equal(v, before[k])
                                         for k, v in _state(model).items()))
    model = _build(hsdp.init_mesh(4, world // 4, "cpu", outer_sync=hsdp.DiLoCo(10)))
    lm_loss(model(tokens), tokens).backward()
    head = [p for n, p in model.named_parameters() if n.startswith("blocks")]
    opt = torch.optim.SGD(head, lr=1.0)
    before = _state(model)
    out["optimizer"] = _error(opt.step)
    out["optimizer_unchanged"] = str(all(torch.equal(v, before[k])
                                         for k, v in _state(model).items()))
    return out
