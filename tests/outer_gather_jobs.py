"""Multi-rank jobs of hfsdp's compressed outer parameter all-gather (``outer_gather``): the
gathered weights against a quantize-dequantize of the exact chunks written out here, the
same weights on every rank, exact main weights, checkpoints, bytes, bad input."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from outer_reduce_jobs import _state, _train, _units

import hsdp
from hsdp.sharding.comm import Collectives
from hsdp.sharding.group import ParamGroup
from hsdp_tools.models import GPT, GPTConfig, lm_loss

INT8 = hsdp.OuterGather("int8", block=16)
FP8 = hsdp.OuterGather("fp8_e4m3", block=32)
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


def _build(mesh: object, seed: int, outer_gather: hsdp.OuterGather | None = INT8,
           mp: bool = False, outer_reduce: hsdp.OuterReduce | None = None) -> nn.Module:
    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    kw = dict(mesh=mesh, strategy="hfsdp", outer_reduce=outer_reduce, outer_gather=outer_gather,
              mp_policy=hsdp.MixedPrecision(torch.bfloat16, torch.float32) if mp else None)
    for blk in model.blocks:
        hsdp.fully_shard(blk, **kw)
    return hsdp.fully_shard(model, **kw)


def _groups(model: nn.Module) -> list[ParamGroup]:
    return [g for u in _units(model) for g in u.groups if g.shard_outer]


def _quantized(chunk: torch.Tensor, cfg: hsdp.OuterGather) -> torch.Tensor:
    """``chunk`` (1-D) quantized and dequantized block by block, written out: each block's
    scale is its absolute maximum over the format's largest value (1 for an all-zero
    block); int8 rounds to nearest even, fp8 casts."""
    pad = -chunk.numel() % cfg.block
    x = torch.cat([chunk.float(), chunk.new_zeros(pad, dtype=torch.float32)])
    x = x.view(-1, cfg.block)
    scale = x.abs().amax(dim=1, keepdim=True) * (1 / _QMAX[cfg.dtype])
    scale[scale == 0] = 1.0
    if cfg.dtype == "int8":
        q = torch.round(x / scale)
    else:
        q = (x / scale).to(torch.float8_e4m3fn).float()
    return (q * scale).view(-1)[:chunk.numel()]


def _inner(g: ParamGroup) -> torch.Tensor:
    """hfsdp's inner shard of ``g``."""
    return g.buffers.inner_shard


def _window(g: ParamGroup) -> torch.Tensor:
    """The part of ``g``'s inner shard where its ``main`` chunk lies."""
    return g.buffers.inner_shard[g.buffers.chunk_offset:][:g.main.numel()]


def _expected_inner_shard(g: ParamGroup, cfg: hsdp.OuterGather) -> torch.Tensor:
    """Every outer rank's exact chunk, quantized and dequantized, in the parameter dtype."""
    chunks = [torch.empty_like(g.main) for _ in range(g.comms.outer_size)]
    dist.all_gather(chunks, g.main, group=g.comms.host_outer)
    return torch.cat([_quantized(c, cfg) for c in chunks]).to(_inner(g).dtype)


def _same_on_world(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(x, everyone[0]) for x in everyone)


def _gathered_weights_agree(model: nn.Module) -> bool:
    """Each unit's whole gathered weights (``module.unshard()``), compared over every rank
    of the world: the outer all-gather's replicas and the inner all-gather agree."""
    ok = True
    for unit in _units(model):
        unit.module.unshard()
        for g in unit.groups:
            ok &= _same_on_world(g.buffers.gathered.view(torch.uint8))
        unit.module.reshard()
    return ok


CASES = {"int8": (INT8, False), "int8-bf16": (INT8, True), "fp8": (FP8, False),
         "int8-bf16+reduce": (INT8, True)}


def parity_job(rank: int, world: int, outer: int, cases: tuple[str, ...] = tuple(CASES)
               ) -> dict[str, dict[str, bool]]:
    """A forward, then two AdamW steps of each case on an ``outer x world/outer`` mesh; per
    case: after the forward and after the steps every group's inner shard equals the
    written-out quantization of the exact chunks, bit for bit; the gathered weights are
    the same on every rank of the world; they are not the exact weights (the quantization
    changed some); main is not the inner shard's storage; the loss stayed finite."""
    mesh = hsdp.init_mesh(outer, world // outer, "cpu")
    out = {}
    for name in cases:
        cfg, mp = CASES[name]
        reduce = hsdp.OuterReduce("int8", block=16) if name.endswith("+reduce") else None
        model = _build(mesh, 0, cfg, mp, reduce)
        tokens = torch.zeros(ROWS, GPTConfig().seq, dtype=torch.long)
        with torch.no_grad():
            model(tokens)  # before any step: the initial weights, gathered quantized
        hsdp.synchronize(model)
        groups = _groups(model)
        first = all(torch.equal(_inner(g), _expected_inner_shard(g, cfg)) for g in groups)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, rank, world, range(2))
        hsdp.synchronize(model)
        out[name] = {
            "first_forward": first,
            "bit_exact": all(torch.equal(_inner(g), _expected_inner_shard(g, cfg))
                             for g in groups),
            "replicas_identical": _gathered_weights_agree(model),
            "quantized": any(not torch.equal(_window(g),
                                             g.main.to(_inner(g).dtype)) for g in groups),
            "main_apart": all(g.main.untyped_storage().data_ptr()
                              != _inner(g).untyped_storage().data_ptr() for g in groups),
            "finite": bool(torch.isfinite(lm_loss(model(tokens), tokens)).item()),
        }
    return out


ROWS = 2


def _set_grads(model: nn.Module) -> None:
    """The same gradient for the same weights in every model: a function of the weights."""
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 0.01


def same_grads_job(rank: int, world: int, outer: int) -> dict[str, dict[str, bool]]:
    """One AdamW step from the same gradients (set by hand, no backward) with the exact and
    the compressed gather, fp32 and bf16 parameters: the exact main weights (and the full
    state dict) are the same bit for bit; only the gathered replicas differ."""
    mesh = hsdp.init_mesh(outer, world // outer, "cpu")
    out = {}
    for mp in (False, True):
        models = [_build(mesh, 0, cfg, mp) for cfg in (None, INT8)]
        before = _state(models[0])
        for m in models:
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            _set_grads(m)
            opt.step()
            m(torch.zeros(ROWS, GPTConfig().seq, dtype=torch.long))  # gathers the update
            hsdp.synchronize(m)
        exact, compressed = (_groups(m) for m in models)
        a, b = (_state(m) for m in models)
        out["bf16" if mp else "fp32"] = {
            "main_equal": all(torch.equal(x.main, y.main) for x, y in zip(exact, compressed)),
            "state_dict_equal": all(torch.equal(a[k], b[k]) for k in a),
            "stepped": all(not torch.equal(a[k], before[k]) for k in a),
            "replicas_differ": any(not torch.equal(_inner(x), _inner(y))
                                   for x, y in zip(exact, compressed)),
            "compressed_bit_exact": all(torch.equal(_inner(y), _expected_inner_shard(y, INT8))
                                        for y in compressed),
        }
    return out


def checkpoint_job(rank: int, world: int, root: str) -> dict[str, bool]:
    """Train 2 steps with the compressed gather and save: what ``hsdp.save`` wrote, loaded
    into a model with the exact gather, is the exact main weights (not the dequantized
    replicas); loaded into a compressed model, 2 more steps are bit for bit those of the
    run that did not stop; ``load_full_state_dict`` leaves the gathered weights quantized."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    path = os.path.join(root, "qgather")
    models = [_build(mesh, 0), _build(mesh, 1, None), _build(mesh, 2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    _train(models[0], opts[0], rank, world, range(2))
    hsdp.save(path, models[0], opts[0])
    saved = _state(models[0])
    mains = [g.main.clone() for g in _groups(models[0])]
    for m, opt in zip(models[1:], opts[1:]):
        hsdp.load(path, m, opt)
    loaded_exact = _state(models[1])
    replicas = [_window(g) for g in _groups(models[0])]
    out = {"saved_exact_main": all(torch.equal(a, b.main) for a, b in zip(mains, _groups(
               models[1]))) and all(torch.equal(saved[k], loaded_exact[k]) for k in saved),
           "replicas_not_saved": any(not torch.equal(r, m) for r, m in zip(replicas, mains))}
    for i in (0, 2):
        _train(models[i], opts[i], rank, world, range(2, 4))
    a, c = _state(models[0]), _state(models[2])
    out["resumed_equal"] = all(torch.equal(a[k], c[k]) for k in a)
    fresh = _build(mesh, 3)
    hsdp.load_full_state_dict(fresh, saved)
    tokens = torch.zeros(ROWS, GPTConfig().seq, dtype=torch.long)
    fresh(tokens)  # the first forward gathers
    hsdp.synchronize(fresh)
    out["full_load_quantized"] = all(torch.equal(_inner(g), _expected_inner_shard(g, INT8))
                                     for g in _groups(fresh))
    return out


class _Bytes(Collectives):
    """Collectives that add up the outer ones' bytes per kind."""

    def __init__(self) -> None:
        super().__init__()
        self.outer: dict[str, int] = {}

    def before(self, kind: str, axis: str, nbytes: int, group_size: int) -> None:
        if axis == "outer":
            self.outer[kind] = self.outer.get(kind, 0) + nbytes


def bytes_job(rank: int, world: int) -> dict[str, dict[str, int]]:
    """Outer collectives of one bf16 hfsdp step (after the first: the gather of the
    updated weights), exact and int8 (block 16): kind -> bytes."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out = {}
    for name, cfg in (("exact", None), ("int8", INT8)):
        model = _build(mesh, 0, cfg, mp=True)
        coll = model._hsdp_unit.collectives = _Bytes()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, rank, world, range(1))
        hsdp.synchronize(model)
        coll.outer.clear()
        _train(model, opt, rank, world, range(1, 2))
        hsdp.synchronize(model)
        out[name] = coll.outer
    return out


def errors_job(rank: int, world: int) -> dict[str, str]:
    """Bad ``outer_gather`` input: the error each rank got, and whether the module was
    left as it was."""
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    cases = {"hsdp": ("hsdp", lambda: INT8), "dtype": ("hfsdp", lambda: hsdp.OuterGather("int4")),
             "block": ("hfsdp", lambda: hsdp.OuterGather("int8", block=100)),
             "block0": ("hfsdp", lambda: hsdp.OuterGather("int8", block=0)),
             "short": ("hfsdp", lambda: "int8:12"), "type": ("hfsdp", lambda: 8)}
    out = {}
    for name, (strategy, make) in cases.items():
        model = GPT(GPTConfig())
        before = list(model.parameters())
        try:
            hsdp.fully_shard(model, mesh=mesh, strategy=strategy, outer_gather=make())
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            unchanged = list(model.parameters()) == before and not hasattr(model, "_hsdp_unit")
            out[name] = f"{type(e).__name__}: {e} (unchanged: {unchanged})"
    out["float8"] = _float8_refused(mesh)
    return out


def _float8_refused(mesh: object) -> str:
    """A unit with torchao float8 weights (float8 all-gather on) and outer_gather."""
    from torchao.float8 import Float8LinearConfig

    from hsdp.float8 import convert_to_float8

    model = convert_to_float8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)),
                              Float8LinearConfig(enable_fsdp_float8_all_gather=True,
                                                 emulate=True))
    before = list(model.parameters())
    try:
        hsdp.fully_shard(model, mesh=mesh, strategy="hfsdp", outer_gather=INT8)
        return "no error"
    except ValueError as e:
        unchanged = list(model.parameters()) == before and not hasattr(model, "_hsdp_unit")
        return f"ValueError: {e} (unchanged: {unchanged})"
