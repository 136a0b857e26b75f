"""Triton kernels of the compressed outer reduction's quantization: the fused path of
``quant.py``'s ``encode`` / ``reduce_rows`` / ``reduce_requantize`` / ``decode_into`` on
CUDA (``quant.py`` dispatches; this module imports triton, so only it may fail to load).

Each pass reads its inputs once and writes its outputs once: ``encode`` reads the source
and the residual and writes the packed rows and the error rows; ``reduce`` reads the ``n``
received rows and writes the fp32 sum (or, re-quantizing, the packed row and what that
dropped); ``decode`` reads packed rows and writes the unpadded result.

Bit-identical to the eager ops on the same GPU: every fp32 operation is the eager one, in
its order, rounded once (launched with ``enable_fp_fusion=False``: no multiply-add is
contracted), and follows torch's CUDA conventions where the eager ops rely on them:

- the block scale is ``amax * fp32(1 / qmax)`` and the mean ``sum * fp32(1 / n)`` (the
  Python number rounded to fp32, as torch rounds a scalar operand); the values are divided
  by their scale in IEEE division (``tl.math.div_rn``: Triton's ``/`` is ``div.full.f32``,
  within 2 ulp, which moved a few values per million to the next int8 / float8 step);
- a block's maximum is NaN if any of its elements is (``vector_norm(inf)``);
- int8 rounds to nearest, ties to even (``torch.round``); float8 e4m3 is cast to nearest,
  ties to even, as torch's cast (no scaled value exceeds 448 by more than rounding);
- the ``n`` rows are summed in rank order (``quant.dequantize_sum``'s order).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from hsdp.sharding.quant import Keep, Pending, Rows

MAX_BLOCK = 8192  # a block is one program's tile at most: larger blocks run eagerly
TILE = 4096  # elements per program (whole blocks)
_VALUES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


@triton.jit
def _block_scale(x, QMAX_RECIP: tl.constexpr, SMIN: tl.constexpr, SMAX: tl.constexpr):
    """Per row of ``x`` ``[G, BLOCK]``: its absolute maximum over qmax, kept within
    [SMIN, SMAX] where finite (``quant.SCALE_RANGE``), NaN where the row holds a NaN."""
    a = tl.abs(x)
    amax = tl.max(a, axis=1)
    amax = tl.where(tl.max((a != a).to(tl.int32), axis=1) > 0, float("nan"), amax)
    scale = amax * QMAX_RECIP
    finite = (scale == scale) & (scale < float("inf"))
    return tl.where(finite, tl.minimum(tl.maximum(scale, SMIN), SMAX), scale)


@triton.jit
def _to_format(y, INT8: tl.constexpr):
    """``y`` (fp32, already scaled: ``|y|`` at most ~127 for int8) rounded to the packed
    format. int8: adding and subtracting 1.5 * 2**23 rounds to the nearest integer, ties to
    even (fp32 addition rounds so), for ``|y| < 2**22``."""
    if INT8:
        return ((y + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        return y.to(tl.float8e4nv)


@triton.jit
def _encode(src, res, vals, scales, err, flag, numel, c, m, row_bytes, row_words, scale_off,
            unchecked, BLOCK: tl.constexpr, GROUP: tl.constexpr, QMAX_RECIP: tl.constexpr,
            SMIN: tl.constexpr, SMAX: tl.constexpr, INT8: tl.constexpr, HAS_RES: tl.constexpr,
            FEEDBACK: tl.constexpr, SELECT: tl.constexpr, KEEP: tl.constexpr,
            LIMIT: tl.constexpr):
    """One program: ``GROUP`` blocks of row ``i``. ``x = src's row (zero-padded) + res``
    (``SELECT``: + ``err`` where ``flag`` is set: each element read, then written, by its
    own program); writes the values and scales, and ``err = x - dequantized`` with
    ``FEEDBACK``; with ``KEEP``, a block of it past ``LIMIT`` or with a NaN is ``res``'s
    (zeros without it) unless ``i`` is row ``unchecked`` (``quant.Keep``)."""
    tiles = tl.cdiv(m, BLOCK * GROUP)
    i = (tl.program_id(0) // tiles).to(tl.int64)
    blocks = (tl.program_id(0) % tiles) * GROUP + tl.arange(0, GROUP)
    j = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = j < m
    flat = i * c + j
    x = tl.load(src + flat, mask=(j < c) & (flat < numel), other=0.0).to(tl.float32)
    if HAS_RES:
        if SELECT:  # the pending rows (``err``) while the flag is set, else ``res``
            if tl.load(flag) != 0:
                x = x + tl.load(err + i * m + j, mask=inside, other=0.0)
            else:
                x = x + tl.load(res + i * m + j, mask=inside, other=0.0)
        else:
            x = x + tl.load(res + i * m + j, mask=inside, other=0.0)
    scale = _block_scale(x, QMAX_RECIP, SMIN, SMAX)
    q = _to_format(tl.math.div_rn(x, scale[:, None]), INT8)
    tl.store(vals + i * row_bytes + j, q, mask=inside)
    tl.store(scales + i * row_words + scale_off + blocks, scale, mask=blocks < m // BLOCK)
    if FEEDBACK:
        e = x - q.to(tl.float32) * scale[:, None]
        if KEEP:
            a = tl.abs(e)
            bad = (tl.max(a, axis=1) > LIMIT) | (tl.max((a != a).to(tl.int32), axis=1) > 0)
            bad = tl.where(i != unchecked, bad, False)
            if HAS_RES:  # read again, for the bad blocks alone (SELECT read ``err``)
                base = tl.load(res + i * m + j, mask=inside & bad[:, None], other=0.0)
                e = tl.where(bad[:, None], base, e)
            else:
                e = tl.where(bad[:, None], 0.0, e)
        tl.store(err + i * m + j, e, mask=inside)


@triton.jit
def _reduce(vals, scales, out, qvals, qscales, m, row_bytes, row_words, scale_off,
            inv_n, N: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
            QMAX_RECIP: tl.constexpr, SMIN: tl.constexpr, SMAX: tl.constexpr,
            INT8: tl.constexpr, MEAN: tl.constexpr, REQUANT: tl.constexpr):
    """One program: ``GROUP`` blocks of the row space, summed over the ``N`` packed rows in
    rank order (times ``inv_n`` with ``MEAN``). Writes the sum to ``out``; with ``REQUANT``
    the sum packed into ``qvals`` / ``qscales`` and ``out`` = sum - dequantized."""
    blocks = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    j = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = j < m
    whole = blocks < m // BLOCK
    acc = (tl.load(vals + j, mask=inside).to(tl.float32)
           * tl.load(scales + scale_off + blocks, mask=whole, other=1.0)[:, None])
    for _ in tl.static_range(1, N):  # unrolled: every row's loads in flight at once
        vals += row_bytes  # the next row (64-bit pointers: no 32-bit row offsets)
        scales += row_words
        v = tl.load(vals + j, mask=inside).to(tl.float32)
        s = tl.load(scales + scale_off + blocks, mask=whole, other=1.0)
        acc = acc + v * s[:, None]
    if MEAN:
        acc = acc * inv_n
    if REQUANT:
        scale = _block_scale(acc, QMAX_RECIP, SMIN, SMAX)
        q = _to_format(tl.math.div_rn(acc, scale[:, None]), INT8)
        tl.store(qvals + j, q, mask=inside)
        tl.store(qscales + scale_off + blocks, scale, mask=whole)
        acc = acc - q.to(tl.float32) * scale[:, None]
    tl.store(out + j, acc, mask=inside)


@triton.jit
def _decode(vals, scales, out, numel, c, m, row_bytes, row_words, scale_off,
            BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """One program: ``GROUP`` blocks of row ``i``, dequantized into ``out`` unpadded."""
    tiles = tl.cdiv(m, BLOCK * GROUP)
    i = (tl.program_id(0) // tiles).to(tl.int64)
    blocks = (tl.program_id(0) % tiles) * GROUP + tl.arange(0, GROUP)
    j = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    flat = i * c + j
    valid = (j < c) & (flat < numel)
    v = tl.load(vals + i * row_bytes + j, mask=valid).to(tl.float32)
    s = tl.load(scales + i * row_words + scale_off + blocks, mask=blocks < m // BLOCK,
                other=1.0)
    tl.store(out + flat, (v * s[:, None]).to(out.dtype.element_ty), mask=valid)


def _views(packed: torch.Tensor, fmt: str, m: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Packed rows as (values, scales): the same bytes typed; and the row geometry."""
    geometry = dict(m=m, row_bytes=packed.shape[1], row_words=packed.shape[1] // 4,
                    scale_off=m // 4)
    return packed.view(_VALUES[fmt]), packed.view(torch.float32), geometry


def _scale_range(fmt: str) -> dict:
    """``quant.SCALE_RANGE[fmt]`` as the kernels' SMIN / SMAX."""
    from hsdp.sharding.quant import SCALE_RANGE  # quant imports this module lazily

    smin, smax = SCALE_RANGE[fmt]
    return dict(SMIN=smin, SMAX=smax)


@cache
def _programs_wanted(device: torch.device) -> int:
    """Programs that fill the GPU twice over (two per multiprocessor; one on the CPU, in
    Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _launch(block: int, blocks: int, device: torch.device) -> dict:
    """Tile shape and launch options for a pass over ``blocks`` blocks: ``GROUP`` blocks
    per program, up to ``TILE`` elements, fewer where that would leave the GPU idle."""
    group = max(1, TILE // block)
    while group > 1 and -(-blocks // group) < _programs_wanted(device):
        group //= 2
    return dict(BLOCK=block, GROUP=group, num_warps=min(16, max(1, group * block // 512)),
                enable_fp_fusion=False)


def encode(src: torch.Tensor, rows: Rows, fmt: str, residual: torch.Tensor | None,
           feedback: bool, pending: Pending | None = None, keep: Keep | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``quant.encode`` in one pass."""
    src = src.contiguous()  # no copy where it is (the kernel reads it flat)
    packed = torch.empty(rows.n, rows.packed, dtype=torch.uint8, device=src.device)
    error = (pending.rows if pending is not None else
             torch.empty(rows.n, rows.m, dtype=torch.float32, device=src.device)
             if feedback else None)
    vals, scales, geometry = _views(packed, fmt, rows.m)
    launch = _launch(rows.block, rows.n * rows.m // rows.block, src.device)
    grid = (rows.n * triton.cdiv(rows.m, rows.block * launch["GROUP"]),)
    _encode[grid](src, residual if residual is not None else src, vals, scales,
                  error if feedback else src, pending.flag if pending is not None else src,
                  rows.numel, rows.c, **geometry, unchecked=keep.unchecked if keep else -1,
                  QMAX_RECIP=1 / _QMAX[fmt], **_scale_range(fmt), INT8=fmt == "int8",
                  HAS_RES=residual is not None, FEEDBACK=feedback, SELECT=pending is not None,
                  KEEP=keep is not None, LIMIT=keep.limit if keep else 0.0, **launch)
    return packed, error


@triton.jit
def _commit(flag, src, dst, numel, TILE_: tl.constexpr):
    """One program: ``TILE_`` elements of ``dst`` = ``src`` if ``flag`` is set."""
    if tl.load(flag) != 0:
        k = tl.program_id(0).to(tl.int64) * TILE_ + tl.arange(0, TILE_)
        tl.store(dst + k, tl.load(src + k, mask=k < numel), mask=k < numel)


def commit(residual: torch.Tensor, pending: Pending) -> None:
    """``quant.commit_pending``'s copy: one pass where the flag is set, none else."""
    numel = residual.numel()
    _commit[(triton.cdiv(numel, TILE),)](pending.flag, pending.rows, residual, numel,
                                         TILE_=TILE, num_warps=8)


def reduce(received: torch.Tensor, rows: Rows, fmt: str, mean: bool,
           requantize: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``quant.reduce_rows`` (``requantize`` False: (sum, None)) or
    ``quant.reduce_requantize`` (``(what the packing dropped, packed)``) in one pass."""
    out = torch.empty(rows.m, dtype=torch.float32, device=received.device)
    vals, scales, geometry = _views(received, fmt, rows.m)
    mine = (torch.empty(1, rows.packed, dtype=torch.uint8, device=received.device)
            if requantize else None)
    qvals, qscales = _views(mine, fmt, rows.m)[:2] if requantize else (vals, scales)
    launch = _launch(rows.block, rows.m // rows.block, received.device)
    grid = (triton.cdiv(rows.m, rows.block * launch["GROUP"]),)
    _reduce[grid](vals, scales, out, qvals, qscales, **geometry, inv_n=1 / rows.n, N=rows.n,
                  QMAX_RECIP=1 / _QMAX[fmt], **_scale_range(fmt), INT8=fmt == "int8", MEAN=mean,
                  REQUANT=requantize, **launch)
    return out, mine


def decode_into(out: torch.Tensor, packed: torch.Tensor, rows: Rows, fmt: str) -> None:
    """``quant.decode_into`` in one pass."""
    if not out.is_contiguous():
        raise ValueError("quant.decode_into: the fused kernel writes a contiguous out")
    vals, scales, geometry = _views(packed, fmt, rows.m)
    launch = _launch(rows.block, rows.n * rows.m // rows.block, packed.device)
    grid = (rows.n * triton.cdiv(rows.m, rows.block * launch["GROUP"]),)
    _decode[grid](vals, scales, out, rows.numel, rows.c, **geometry, **launch)
