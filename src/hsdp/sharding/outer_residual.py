"""The compressed outer reduction's error-feedback residuals in checkpoints: the
``OuterReduce`` mode's state-dict hooks (``outer_reduce.py``, ``topology/outer_mode.py``).

A residual is what quantization dropped from one rank's gradient: no other rank holds it,
and it is not laid out like any parameter. So each rank saves its own, a plain fp32
tensor over its group's inner shard, keyed by mesh shape and this rank's mesh coordinates
("2x2x1:1-0-0"; in the optimizer's state dict under ``OuterReduce.state_key`` after the
group's name, "blocks.0/0@2x2x1:1-0-0"). Resuming on the same mesh restores every residual
bit for bit. On a mesh of another shape (same tp size) a rank reads the residuals of the
old ranks whose inner shards overlap its own (flat-layout offsets do not depend on the
mesh) and takes their mean over the old outer ranks (gradient means; for sums, their sum
over the new outer size), so the next reduction gets back what the old ranks dropped
together. A checkpoint saved without compression has none: the residuals start at zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hsdp.topology.outer_mode import Entries, place

if TYPE_CHECKING:
    from hsdp.sharding.group import ParamGroup


def _key(g: ParamGroup) -> str | None:
    """The key of ``g``'s residual on this rank; None: it has none."""
    if g.compressed is None or not g.compressed.config.error_feedback:
        return None
    return place(g.comms)


def _parse(key: str) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((outer, inner, tp) sizes, (o, i, t) coordinates) of a residual's key."""
    sizes, _, coords = key.partition(":")
    return (tuple(int(x) for x in sizes.split("x")),
            tuple(int(x) for x in coords.split("-")))


def _others(key: str, g: ParamGroup, sizes: dict[str, int]) -> dict[str, int]:
    """Of the residuals ``sizes`` (key -> elements), those of ``key``'s tp index saved on
    another mesh whose inner shards overlap this rank's."""
    (_, _, tp), (_, _, t) = _parse(key)
    n = g.compressed.rows.numel
    lo = g.comms.inner_rank * n
    out = {}
    for other, numel in sizes.items():
        (_, _, otp), (_, i, ot) = _parse(other)
        if (otp, ot) == (tp, t) and i * numel < lo + n and lo < (i + 1) * numel:
            out[other] = numel
    return out


def state(g: ParamGroup) -> Entries:
    """This rank's residual of ``g`` (a copy), by key."""
    key = _key(g)
    return {} if key is None else {key: g.compressed.residual_flat()}


def load(g: ParamGroup, entries: Entries) -> None:
    """Set this rank's residual of ``g`` from ``entries`` (``state``'s form); missing:
    zero."""
    key = _key(g)
    if key is not None:
        g.compressed.load_residual(entries.get(key))


def to_read(g: ParamGroup, ours: Entries, saved: dict[str, tuple[int, ...]]) -> Entries:
    """What to read of a checkpoint that holds ``saved`` (key -> shape): this rank's own
    residual where it holds it with the same shape, else (another mesh) the overlapping
    old ones (``_others``), into zero CPU tensors."""
    key = _key(g)
    if key is None:
        return {}
    sizes = {k: shape[0] for k, shape in saved.items() if len(shape) == 1}
    if sizes.get(key) == ours[key].numel():
        return {key: ours[key]}
    return {k: torch.zeros(n) for k, n in _others(key, g, sizes).items()}


def from_read(g: ParamGroup, read: Entries) -> Entries:
    """This rank's residual from ``to_read``'s entries once read: its own, or the mean over
    the old outer ranks of the old ones at its shard's positions (module doc)."""
    key = _key(g)
    if key is None:
        return {}
    n = g.compressed.rows.numel
    if key in read and read[key].numel() == n:
        return {key: read[key]}
    others = _others(key, g, {k: v.numel() for k, v in read.items()})
    if not others:  # this key of another size: another strategy's
        return {}
    lo = g.comms.inner_rank * n
    acc = torch.zeros(n)
    for other, numel in others.items():
        (old_outer, _, _), (_, i, _) = _parse(other)
        a, b = max(lo, i * numel), min(lo + n, (i + 1) * numel)
        acc[a - lo:b - lo] += read[other][a - i * numel:b - i * numel]
    return {key: acc.div_(old_outer if g.divide_factor is None else g.comms.outer_size)}
