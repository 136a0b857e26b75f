"""Multi-rank jobs of the compressed outer reduction (``outer_reduce``): checkpoints carry
the error-feedback residual, composition with microbatches, bad input."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from parity_jobs import ROWS_PER_RANK, _batches

import hsdp
from hsdp.checkpoint.extra_state import apply, extra_state
from hsdp.sharding.comm import Collectives
from hsdp_tools.models import GPT, GPTConfig, lm_loss

K = 2  # steps before the save, and again after the load
INT8 = hsdp.OuterReduce("int8", block=16)


def _build(mesh: object, strategy: str, seed: int, mp: bool = False,
           outer_reduce: hsdp.OuterReduce | None = INT8) -> nn.Module:
    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    policy = hsdp.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, strategy=strategy, mp_policy=policy,
                         outer_reduce=outer_reduce)
    return hsdp.fully_shard(model, mesh=mesh, strategy=strategy, mp_policy=policy,
                            outer_reduce=outer_reduce)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int,
           steps: range, microbatches: int = 1) -> None:
    cfg = GPTConfig()
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    for step in steps:
        for m in range(microbatches):
            tokens = _batches(step, m, world, cfg)[rows]
            with hsdp.microbatch(model, is_last=m == microbatches - 1):
                (lm_loss(model(tokens), tokens) / microbatches).backward()
        opt.step()
        opt.zero_grad()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in hsdp.full_state_dict(model).items()}


def resume_job(rank: int, world: int, root: str) -> dict[str, object]:
    """Train K steps, save, train K more; a differently seeded model loads the checkpoint
    and trains the same K steps: bit for bit the same parameters (and the same residuals)?
    A control whose residuals are zeroed after the load: does it differ? The hsdp 2x2
    checkpoint loaded on 4x1: each residual the mean of the old ones over outer."""
    out: dict[str, object] = {}
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    for strategy, mp in (("hsdp", False), ("hfsdp", False), ("hsdp", True)):
        name = f"{strategy}{'-bf16' if mp else ''}"
        path = os.path.join(root, name)
        models = [_build(mesh, strategy, seed, mp) for seed in (0, 1, 2)]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        _train(models[0], opts[0], rank, world, range(K))
        hsdp.save(path, models[0], opts[0])
        saved = _residual_state(models[0])
        _train(models[0], opts[0], rank, world, range(K, 2 * K))
        for m, opt in zip(models[1:], opts[1:]):
            hsdp.load(path, m, opt)
        loaded = _residual_state(models[1])
        apply(models[2], {}, None)  # the control: no residual
        for m, opt in zip(models[1:], opts[1:]):
            _train(m, opt, rank, world, range(K, 2 * K))
        a, b, c = (_state(m) for m in models)
        out[name] = {
            "residual_saved_nonzero": all(t.any().item() for t in saved.values()),
            "residual_loaded_equal": saved.keys() == loaded.keys() and all(
                torch.equal(saved[k], loaded[k]) for k in saved),
            "resumed_equal": all(torch.equal(a[k], b[k]) for k in a),
            "control_differs": any(not torch.equal(a[k], c[k]) for k in a),
        }
        if name == "hsdp":
            saved_hsdp = saved
    # On (world x 1): each group's residual is the mean over the old outer ranks of the
    # old residuals, laid back to back over the old inner ranks (one inner shard now).
    old: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    dist.all_gather_object(old, saved_hsdp)
    expected: dict[str, torch.Tensor] = {}
    for key in sorted(k for per_rank in old for k in per_rank):
        _, _, coords = key.rpartition(":")
        t = next(per_rank[key] for per_rank in old if key in per_rank)
        group, i = key.split("@")[0], int(coords.split("-")[1])
        acc = expected.setdefault(group, torch.zeros(2 * t.numel()))
        acc[i * t.numel():(i + 1) * t.numel()] += t / 2
    other = _build(hsdp.init_mesh(world, 1, "cpu"), "hsdp", 3)
    opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    hsdp.load(os.path.join(root, "hsdp"), other, opt)
    got = {k.split("@")[0]: v for k, v in _residual_state(other).items()}
    out["reshard_residual_mean"] = got.keys() == expected.keys() and all(
        torch.allclose(got[k], expected[k][:got[k].numel()], rtol=1e-6, atol=0)
        and not expected[k][got[k].numel():].any() for k in got)
    return out


class _Counting(Collectives):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def before(self, kind: str, axis: str, nbytes: int, group_size: int) -> None:
        self.calls.append((kind, axis))


def microbatch_job(rank: int, world: int) -> dict[str, int]:
    """Outer collectives of one step with 3 microbatches: one compressed reduction per
    group (quantized once, at the last microbatch), per strategy."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out = {}
    for strategy in ("hsdp", "hfsdp"):
        model = _build(mesh, strategy, 0)
        coll = model._hsdp_unit.collectives = _Counting()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(model, opt, rank, world, range(1), microbatches=3)
        hsdp.synchronize(model)
        outer = [k for k, axis in coll.calls if axis == "outer"]
        groups = sum(len(u.groups) for u in _units(model))
        out[strategy] = (outer.count("all_to_all"), outer.count("all_gather"),
                         outer.count("all_reduce") + outer.count("reduce_scatter"), groups)
    return out


def divide_job(rank: int, world: int) -> dict[str, float]:
    """``set_gradient_divide_factor(1.0)`` (sums, as torchtitan sets it): the compressed
    reduction's gradients against the exact one's after two steps of error feedback,
    relative error of all gradients, per strategy."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out = {}
    for strategy in ("hsdp", "hfsdp"):
        grads = []
        for outer_reduce in (None, INT8):
            model = _build(mesh, strategy, 0, outer_reduce=outer_reduce)
            model.set_gradient_divide_factor(1.0)
            opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the gradients only
            cfg, rows = GPTConfig(), slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
            for step in range(2):
                opt.zero_grad()
                tokens = _batches(step, 0, world, cfg)[rows]
                lm_loss(model(tokens), tokens).backward()
                opt.step()
            grads.append(torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()
                                    if p.grad is not None]))
        exact, compressed = grads
        out[strategy] = ((compressed - exact).norm() / exact.norm()).item()
    return out


def _units(model: nn.Module) -> list:
    return [m._hsdp_unit for m in model.modules() if "_hsdp_unit" in vars(m)]


def errors_job(rank: int, world: int) -> dict[str, str]:
    """Bad ``outer_reduce`` input: the error each rank got, and whether the module was
    left as it was."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out = {}
    for name, make in (("dtype", lambda: hsdp.OuterReduce("int4")),
                       ("block", lambda: hsdp.OuterReduce("int8", block=100)),
                       ("type", lambda: 8)):
        model = GPT(GPTConfig())
        before = [p for p in model.parameters()]
        try:
            hsdp.fully_shard(model, mesh=mesh, outer_reduce=make())
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            unchanged = [p for p in model.parameters()] == before and not hasattr(
                model, "_hsdp_unit")
            out[name] = f"{type(e).__name__}: {e} (unchanged: {unchanged})"
    return out


class _Chooser:
    """A chooser that returns ``pick(rank)`` (or raises it, an exception) and counts its
    calls."""

    def __init__(self, pick: object) -> None:
        self.pick, self.calls = pick, 0

    def __call__(self, mesh: object) -> object:
        self.calls += 1
        got = self.pick(dist.get_rank())
        if isinstance(got, Exception):
            raise got
        return got


DILOCO = hsdp.DiLoCo(inner_steps=3)
AUTO_CASES = {  # case: what the chooser returns on a rank
    "int8": lambda r: hsdp.OuterChoice("int8:16", None, "int8 measured fastest"),
    "diloco": lambda r: hsdp.OuterChoice(None, DILOCO, "DiLoCo measured fastest"),
    "exact": lambda r: hsdp.OuterChoice(None, None, "exact measured fastest"),
    "not_a_choice": lambda r: "int8",
    "bad_reduce": lambda r: hsdp.OuterChoice("int4", None),
    "differ": lambda r: hsdp.OuterChoice("int8" if r == 3 else None, None),
    "raises_on_1": lambda r: RuntimeError("link probe failed") if r == 1 else
    hsdp.OuterChoice(None, None),
}


@contextmanager
def auto_log() -> Iterator[list[str]]:
    """What ``hsdp.Auto`` logs (logger ``hsdp.outer_auto``, INFO) while inside."""
    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logger = logging.getLogger("hsdp.outer_auto")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield notes
    finally:
        logger.removeHandler(handler)


def outer_reduce_of(group: object) -> str:
    """The ``OuterReduce`` among ``group``'s outer modes, as text ("None": exact)."""
    return str(next((o for o in group.outer if isinstance(o, hsdp.OuterReduce)), None))


def _auto_case(case: str, world: int, notes: list[str]) -> dict[str, object]:
    """init_mesh(outer_sync=auto) and fully_shard(outer_reduce=auto) with the chooser of
    ``case``: the mesh's outer sync, each unit's outer_reduce, the chooser's calls and
    what was logged; or the error and whether the mesh and model were left as they were."""
    from hsdp.topology.outer_mode import outer_sync_of

    plain = hsdp.init_mesh(2, world // 2, "cpu")  # no outer sync
    chooser = _Chooser(AUTO_CASES[case])
    auto = hsdp.Auto(chooser, name=case)
    try:
        mesh = hsdp.init_mesh(2, world // 2, "cpu", outer_sync=auto)
        model = _build(mesh, "hsdp", 0, outer_reduce=auto)
    except (TypeError, ValueError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}", "calls": chooser.calls,
                "mesh_unchanged": outer_sync_of(plain) is None,
                "logged": list(notes)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, dist.get_rank(), world, range(1))
    return {"outer_sync": outer_sync_of(mesh), "calls": chooser.calls,
            "outer_reduce": sorted({outer_reduce_of(g) for m in model.modules()
                                    if getattr(m, "_hsdp_unit", None)
                                    for g in m._hsdp_unit.groups}),
            "logged": list(notes)}


def auto_job(rank: int, world: int) -> dict[str, object]:
    """Each of AUTO_CASES; then outer_reduce=auto on a mesh made without it whose chooser
    picks DiLoCo, and the strings "auto"."""
    out: dict[str, object] = {}
    with auto_log() as notes:
        for case in AUTO_CASES:
            out[case] = _auto_case(case, world, notes)
            notes.clear()
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    for case, call in (
            ("diloco_not_on_mesh", lambda m: hsdp.fully_shard(
                m, mesh=mesh, outer_reduce=hsdp.Auto(_Chooser(AUTO_CASES["diloco"])))),
            ("reduce_string", lambda m: hsdp.fully_shard(m, mesh=mesh, outer_reduce="auto")),
            ("sync_string", lambda m: hsdp.init_mesh(2, world // 2, "cpu", outer_sync="auto"))):
        model = GPT(GPTConfig())
        try:
            call(model)
            out[case] = "no error"
        except (TypeError, ValueError) as e:
            out[case] = f"{type(e).__name__}: {e} (unsharded: {not hasattr(model, '_hsdp_unit')})"
    return out


def _residual_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's error-feedback residuals (copies), by key."""
    return extra_state(model, None).get(hsdp.OuterReduce.state_key, {})
