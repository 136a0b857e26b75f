"""Flat-buffer layout and shard math for one parameter group (pure: no tensors, no comms).

A group's parameters are laid out back to back in one flat buffer of ``total`` elements,
each starting at a multiple of ``align`` elements (aligned views keep GEMMs on their fast
paths). The buffer is split into ``inner`` equal shards of ``shard_numel`` elements; with
outer sharding (HFSDP) each inner shard is split again into ``outer`` chunks of
``chunk_numel`` elements. Inner rank ``i`` holds ``[i*S, (i+1)*S)``; the optimizer range of
(outer rank ``o``, inner rank ``i``) is ``[i*S + o*C, i*S + (o+1)*C)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALIGN_ELEMS = 16


@dataclass(frozen=True)
class ParamSpan:
    """The part of parameter ``index`` that falls into a range of the flat buffer."""

    index: int
    param_start: int  # first element inside the parameter (flattened)
    length: int
    range_offset: int  # where it starts inside the range


@dataclass(frozen=True)
class FlatLayout:
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    total: int
    inner: int
    outer: int
    shard_outer: bool

    @staticmethod
    def build(
        shapes: list[tuple[int, ...]],
        inner: int,
        outer: int,
        shard_outer: bool,
        align: int = ALIGN_ELEMS,
    ) -> FlatLayout:
        if inner < 1 or outer < 1:
            raise ValueError(f"mesh sizes must be >= 1, got outer={outer} inner={inner}")
        offsets, pos = [], 0
        for shape in shapes:
            pos = _round_up(pos, align)
            offsets.append(pos)
            pos += math.prod(shape)
        # Each inner shard (and each outer chunk of it) is a whole number of aligned blocks.
        unit = align * inner * (outer if shard_outer else 1)
        total = max(_round_up(pos, unit), unit)
        return FlatLayout(tuple(tuple(s) for s in shapes), tuple(offsets), total, inner, outer,
                          shard_outer)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def shard_numel(self) -> int:
        """Elements per inner shard (S)."""
        return self.total // self.inner

    @property
    def chunk_numel(self) -> int:
        """Elements this rank's optimizer owns (C): S for hsdp, S/outer for hfsdp."""
        return self.shard_numel // (self.outer if self.shard_outer else 1)

    def inner_range(self, inner_rank: int) -> tuple[int, int]:
        lo = inner_rank * self.shard_numel
        return lo, lo + self.shard_numel

    def owned_range(self, outer_rank: int, inner_rank: int) -> tuple[int, int]:
        lo = inner_rank * self.shard_numel
        if self.shard_outer:
            lo += outer_rank * self.chunk_numel
        return lo, lo + self.chunk_numel

    def pieces(self, lo: int, hi: int) -> list[ParamSpan | None]:
        """For each parameter, its overlap with ``[lo, hi)`` (None where there is none)."""
        out: list[ParamSpan | None] = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(off, lo), min(off + n, hi)
            out.append(ParamSpan(i, a - off, b - a, a - lo) if a < b else None)
        return out

    def segments(self) -> list[tuple[int, int | None]]:
        """The flat buffer front to back as (length, parameter index; None: padding)."""
        spans = [(a, b - a, None) for a, b in self.gaps()]
        spans += [(off, n, i) for i, (off, n) in enumerate(zip(self.offsets, self.numels))]
        return [(n, i) for _, n, i in sorted(spans, key=lambda s: s[0])]

    def gaps(self) -> list[tuple[int, int]]:
        """Ranges ``[a, b)`` of the flat buffer that hold no parameter (padding)."""
        out, pos = [], 0
        for off, n in zip(self.offsets, self.numels):
            if off > pos:
                out.append((pos, off))
            pos = off + n
        if self.total > pos:
            out.append((pos, self.total))
        return out


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class Box:
    """A rectangular block of a tensor (``offsets``/``sizes`` per dim) whose elements are
    consecutive in row-major order, starting ``start`` elements into a flat range."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as few boxes, in order
    (a partial row, whole rows, a partial row; recursively per dim). The pieces of a flat
    buffer are such ranges; DCP describes a shard as boxes."""
    if lo >= hi:
        return []
    if not shape:
        return [Box((), (), 0)]
    row = math.prod(shape[1:])
    out: list[Box] = []
    pos = lo
    for a, b, whole in _row_spans(lo, hi, row):
        if whole:
            out.append(Box((a // row,) + (0,) * (len(shape) - 1),
                           ((b - a) // row,) + tuple(shape[1:]), pos - lo))
        else:
            r = a // row
            out.extend(Box((r,) + s.offsets, (1,) + s.sizes, pos - lo + s.start)
                       for s in boxes(tuple(shape[1:]), a - r * row, b - r * row))
        pos = b
    return out


def _row_spans(lo: int, hi: int, row: int) -> list[tuple[int, int, bool]]:
    """``[lo, hi)`` split at row boundaries into (a, b, whole rows?): at most a partial
    head, a run of whole rows and a partial tail."""
    spans = []
    head = min(hi, _round_up(lo, row))
    if head > lo:
        spans.append((lo, head, False))
    tail = max(head, hi // row * row)
    if tail > head:
        spans.append((head, tail, True))
    if hi > tail:
        spans.append((tail, hi, False))
    return spans
