"""The compressed outer reduction's error-feedback residuals in checkpoints.

A residual is what quantization dropped from one rank's gradient: no other rank holds it,
and it is not laid out like any parameter. So each rank saves its own, a plain fp32
tensor over its group's inner shard, in the optimizer's state dict under ``KEY``, keyed
by unit, group, mesh shape and this rank's mesh coordinates ("blocks.0/0@2x2x1:1-0-0").
Resuming on the same mesh restores every residual bit for bit. On a mesh of another
shape (same tp size) a rank reads the residuals of the old ranks whose inner shards
overlap its own (flat-layout offsets do not depend on the mesh) and takes their mean over
the old outer ranks (gradient means; for sums, their sum over the new outer size), so the
next reduction gets back what the old ranks dropped together. A checkpoint saved without
compression has none: the residuals start at zero.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from hsdp.checkpoint.full_state import clean_key
from hsdp.runtime.hooks import units_below
from hsdp.sharding.group import ParamGroup

KEY = "hsdp_outer_residual"


def _groups(model: nn.Module) -> Iterator[tuple[str, ParamGroup]]:
    """(key, group) of every group of ``model`` with an error-feedback residual."""
    names = {id(m): clean_key(n) for n, m in model.named_modules()}
    for unit in units_below(model):
        for g in unit.groups:
            if g.compressed is None or not g.compressed.config.error_feedback:
                continue
            c = g.comms
            t = 0 if c.host_tp is None else dist.get_rank(c.host_tp)
            where = f"{c.outer_size}x{c.inner_size}x{c.tp_size}:{c.outer_rank}-{c.inner_rank}-{t}"
            group = f"{names.get(id(unit.module), unit.label)}/{g.label.rsplit('/', 1)[1]}"
            yield f"{group}@{where}", g


def _parse(key: str) -> tuple[str, tuple[int, int, int], tuple[int, int, int]]:
    """(group, (outer, inner, tp) sizes, (o, i, t) coordinates) of a residual's key."""
    group, _, where = key.rpartition("@")
    sizes, _, coords = where.partition(":")
    return (group, tuple(int(x) for x in sizes.split("x")),
            tuple(int(x) for x in coords.split("-")))


def _others(key: str, g: ParamGroup, sizes: dict[str, int]) -> dict[str, int]:
    """Of the residuals ``sizes`` (key -> elements), those of ``key``'s group and tp
    index saved on another mesh whose inner shards overlap this rank's."""
    group, (_, _, tp), (_, _, t) = _parse(key)
    n = g.compressed.rows.numel
    lo = g.comms.inner_rank * n
    out = {}
    for other, numel in sizes.items():
        og, (_, _, otp), (_, i, ot) = _parse(other)
        if og == group and (otp, ot) == (tp, t) and i * numel < lo + n and lo < (i + 1) * numel:
            out[other] = numel
    return out


def residual_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's residuals (copies), by key."""
    return {key: g.compressed.residual_flat() for key, g in _groups(model)}


def load_residuals(model: nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Set this rank's residuals from ``state`` (``residual_state``'s form); a group
    whose key is missing starts from zero."""
    state = state or {}
    for key, g in _groups(model):
        g.compressed.load_residual(state.get(key))


def to_read(model: nn.Module, state: dict[str, torch.Tensor], saved: dict[str, object],
            prefix: str) -> dict[str, torch.Tensor]:
    """What to read of the checkpoint whose metadata is ``saved`` (DCP's flattened keys,
    ``prefix`` + key): this rank's own residuals where it holds them with the same shape,
    else (another mesh) the overlapping old ones (``_others``), into zero CPU tensors."""
    sizes = {k[len(prefix):]: int(md.size[0]) for k, md in saved.items()
             if k.startswith(prefix) and getattr(md, "size", None) is not None}
    out = {}
    for key, g in _groups(model):
        if sizes.get(key) == state[key].numel():
            out[key] = state[key]
        else:
            out.update({k: torch.zeros(n) for k, n in _others(key, g, sizes).items()})
    return out


def from_read(model: nn.Module, read: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's residuals from ``to_read``'s entries once read: its own, or the mean
    over the old outer ranks of the old ones at its shard's positions (module doc)."""
    out = {}
    sizes = {k: v.numel() for k, v in read.items()}
    for key, g in _groups(model):
        n = g.compressed.rows.numel
        if key in read and read[key].numel() == n:
            out[key] = read[key]
            continue
        others = _others(key, g, sizes)  # this key of another size: another strategy's
        if not others:
            continue
        lo = g.comms.inner_rank * n
        acc = torch.zeros(n)
        for other, numel in others.items():
            _, (old_outer, _, _), (_, i, _) = _parse(other)
            a, b = max(lo, i * numel), min(lo + n, (i + 1) * numel)
            acc[a - lo:b - lo] += read[other][a - i * numel:b - i * numel]
        out[key] = acc.div_(old_outer if g.divide_factor is None else g.comms.outer_size)
    return out
