"""Blockwise 8-bit quantization for the compressed outer reduction (pure tensor math: no
communication, no state).

A 1-D buffer of ``numel`` elements is cut into ``n`` rows of ``c = ceil(numel / n)``
elements (one per outer rank: the part that rank reduces), each zero-padded to ``m``
elements, a whole number of blocks. Each block of ``block`` elements is scaled by its
absolute maximum over the format's largest value (fp32 scale) and rounded to one byte
(int8: to nearest, ties to even; float8 e4m3: torch's cast). A row travels packed as
``m`` bytes of values followed by its scales' bytes, so one collective moves both.

The passes of the reduction (``encode``, ``reduce_rows``, ``reduce_requantize``,
``decode_into``) run as fused Triton kernels on CUDA tensors where triton imports
(``quant_kernels.py``, bit-identical to the eager ops on the same GPU), else as the eager
torch ops below (CPU, and the reference); ``uses_kernels`` is where that is decided.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

_FORMATS = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}
_TINY = torch.finfo(torch.float32).tiny  # the smallest scale: |x| / scale stays in range


def _largest_scale(qmax: float) -> float:
    """The largest fp32 scale whose ``qmax`` multiple is finite: a finite block
    dequantizes finite (``max / qmax`` rounded up would overflow)."""
    zero = torch.zeros((), dtype=torch.float32)
    scale = torch.tensor(torch.finfo(torch.float32).max / qmax, dtype=torch.float32)
    while not torch.isfinite(scale * qmax):
        scale = torch.nextafter(scale, zero)
    return scale.item()


SCALE_RANGE = {fmt: (_TINY, _largest_scale(qmax)) for fmt, (_, qmax) in _FORMATS.items()}


@dataclass(frozen=True)
class Rows:
    """How a buffer of ``numel`` elements is cut into ``n`` padded rows of ``m``."""

    numel: int
    n: int
    block: int

    @property
    def c(self) -> int:
        """Elements of the buffer per row (the last row may hold fewer)."""
        return -(-self.numel // self.n)

    @property
    def m(self) -> int:
        """Row length, padded to whole blocks."""
        return -(-max(self.c, 1) // self.block) * self.block

    @property
    def packed(self) -> int:
        """Bytes of one packed row: the values, then one fp32 scale per block."""
        return self.m + 4 * (self.m // self.block)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (1-D, ``numel``) as fp32 rows ``[n, m]``, zero-padded (a new tensor)."""
        out = torch.zeros(self.n, self.m, dtype=torch.float32, device=x.device)
        full, tail = divmod(self.numel, self.c)
        out[:full, :self.c].copy_(x[:full * self.c].view(full, self.c))
        if tail:
            out[full, :tail].copy_(x[full * self.c:])
        return out

    def join(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of ``split``: the first ``numel`` elements of ``rows`` unpadded."""
        return rows[:, :self.c].reshape(-1)[:self.numel]

    def join_into(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """``out.copy_(join(rows))``, in one copy where the rows are whole."""
        if self.n * self.c == self.numel:
            out.view(self.n, self.c).copy_(rows[:, :self.c])
        else:
            out.copy_(self.join(rows))


def quantize(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Rows ``x`` (fp32 ``[r, m]``, ``m`` a multiple of ``block``) packed: uint8
    ``[r, m + 4 * m / block]``. Few passes over ``x`` (this runs per unit and step on the
    outer stream): the block maxima in one reduction, one scaling, (int8) one rounding,
    one cast; no clamp is needed, ``|x| / scale`` is at most the format's maximum. Finite
    scales are kept within ``SCALE_RANGE`` (a denormal one would push ``|x| / scale``
    past the format, one near fp32's maximum would dequantize to inf); a block with a
    NaN or inf has a NaN or inf scale, so the whole block dequantizes non-finite."""
    dtype, qmax = _FORMATS[fmt]
    r, m = x.shape
    xb = x.view(r, m // block, block)
    # times the fp32 reciprocal, as torch's CUDA division by a number does: one result on
    # every device (the fused kernels' too)
    scale = torch.linalg.vector_norm(xb, float("inf"), dim=-1, keepdim=True).mul_(1 / qmax)
    scale = torch.where(scale.isfinite(), scale.clamp(*SCALE_RANGE[fmt]), scale)
    q = xb / scale
    if dtype == torch.int8:
        q.round_()
    out = torch.empty(r, m + 4 * (m // block), dtype=torch.uint8, device=x.device)
    out[:, :m].view(dtype).copy_(q.view(r, m))
    out[:, m:].copy_(scale.view(r, m // block).view(torch.uint8))
    return out


def _scaled(packed: torch.Tensor, fmt: str, block: int, m: int) -> torch.Tensor:
    """fp32 ``[r, m / block, block]``: the values times their scales."""
    dtype, _ = _FORMATS[fmt]
    r = packed.shape[0]
    scale = packed[:, m:].contiguous().view(torch.float32).unsqueeze(-1)
    values = packed[:, :m].view(dtype).view(r, m // block, block)
    # int8 * fp32 promotes inside one kernel; torch has no float8 promotion: cast first
    return values * scale if dtype == torch.int8 else values.float() * scale


def dequantize(packed: torch.Tensor, fmt: str, block: int, m: int) -> torch.Tensor:
    """fp32 rows ``[r, m]`` from ``quantize``'s packed rows."""
    return _scaled(packed, fmt, block, m).view(packed.shape[0], m)


def dequantize_sum(packed: torch.Tensor, fmt: str, block: int, m: int) -> torch.Tensor:
    """The fp32 sum ``[m]`` of ``quantize``'s packed rows, dequantized, added in rank order
    (one order on every device and path, the fused kernel's)."""
    scaled = _scaled(packed, fmt, block, m).view(packed.shape[0], m)
    total = scaled[0].clone()
    for row in scaled[1:]:
        total.add_(row)
    return total


@cache
def _cuda_kernels() -> ModuleType | None:
    """``quant_kernels`` (None where triton does not import)."""
    try:
        return importlib.import_module("hsdp.sharding.quant_kernels")
    except ImportError:
        return None


# Fused passes of other device types, ``quant_kernels``' interface: the simulator's on
# meta tensors (hsdp_tools.sim.quant_pricing: it prices the passes as the kernels run).
KERNELS: dict[str, object] = {}


def _kernels(device_type: str = "cuda") -> ModuleType | object | None:
    """The fused passes for ``device_type`` (None: none)."""
    return _cuda_kernels() if device_type == "cuda" else KERNELS.get(device_type)


def uses_kernels(t: torch.Tensor, block: int, fused: bool | None = None) -> bool:
    """Whether a pass over ``t`` runs the fused kernels: CUDA tensors, triton importable
    and blocks of at most ``quant_kernels.MAX_BLOCK`` (or a device type in ``KERNELS``);
    ``fused`` True / False forces a path (tests and benchmarks; True where the kernels
    cannot run is an error)."""
    if fused is False:
        return False
    kernels = _kernels(t.device.type)
    can = kernels is not None and block <= kernels.MAX_BLOCK
    if fused and not can:
        raise RuntimeError(f"quant: the fused kernels need a CUDA tensor, triton and a block "
                           f"of at most 8192 (got {t.device}, block {block}, triton "
                           f"{'found' if kernels is not None else 'missing'})")
    return can


@dataclass(frozen=True)
class Pending:
    """Where a reduction of fixed buffers (CUDA graphs) keeps its residual: ``rows``
    (fp32 ``[n, m]``) receives what the quantization dropped, and is its residual too
    while ``flag`` (int32 ``[1]``, on the device) is not 0 (a reduction's residual not
    yet committed); else the residual is the committed one."""

    rows: torch.Tensor
    flag: torch.Tensor


@dataclass(frozen=True)
class Keep:
    """What ``encode`` keeps of the error it returns: a block whose largest magnitude
    passes ``limit`` or that holds a NaN takes the residual's values instead (zeros
    without one), except in row ``unchecked`` (-1: none; its caller adds to that row
    first, then checks it with ``keep_finite``)."""

    limit: float
    unchecked: int = -1


def keep_finite(error: torch.Tensor, base: torch.Tensor | None, block: int,
                limit: float) -> None:
    """In place: ``error``'s blocks (fp32 ``[..., m]``) whose largest magnitude passes
    ``limit`` or that hold a NaN take ``base``'s values (same shape; None: zeros). No host
    sync: a masked copy."""
    blocks = error.view(*error.shape[:-1], error.shape[-1] // block, block)
    bad = torch.linalg.vector_norm(blocks, float("inf"), dim=-1,
                                   keepdim=True).le(limit).logical_not_()
    if base is None:
        blocks.masked_fill_(bad, 0.0)
    else:
        torch.where(bad, base.view_as(blocks), blocks, out=blocks)


def encode(src: torch.Tensor, rows: Rows, fmt: str, residual: torch.Tensor | None = None,
           feedback: bool = False, fused: bool | None = None, pending: Pending | None = None,
           keep: Keep | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``src`` (1-D, ``rows.numel``) cut into ``rows`` plus ``residual`` (fp32 ``[n, m]``;
    None: zeros), quantized: (packed ``[n, rows.packed]``, with ``feedback`` what the
    quantization dropped, fp32 ``[n, m]``, else None; with ``keep`` its bad blocks
    replaced, ``Keep``). New tensors: the caller decides what becomes its residual; with
    ``pending`` (and ``residual`` and ``feedback``), the residual is ``pending.rows`` where
    its flag is set, and what was dropped is written into ``pending.rows`` (both chosen on
    the device: a graph replays it as it runs)."""
    if pending is not None and (residual is None or not feedback):
        raise ValueError("quant.encode: pending needs a residual and feedback")
    if keep is not None and not feedback:
        raise ValueError("quant.encode: keep needs feedback")
    if uses_kernels(src, rows.block, fused):
        return _kernels(src.device.type).encode(src, rows, fmt, residual, feedback, pending,
                                                keep)
    x = rows.split(src)
    if pending is not None:
        x.add_(torch.where(pending.flag.bool(), pending.rows, residual))
    elif residual is not None:
        x.add_(residual)
    packed = quantize(x, fmt, rows.block)
    if not feedback:
        return packed, None
    error = x.sub_(dequantize(packed, fmt, rows.block, rows.m))
    if keep is not None:
        parts = ((slice(None, keep.unchecked), slice(keep.unchecked + 1, None))
                 if keep.unchecked >= 0 else (slice(None),))
        for part in parts:
            keep_finite(error[part], None if residual is None else residual[part],
                        rows.block, keep.limit)
    if pending is None:
        return packed, error
    return packed, pending.rows.copy_(error)


def commit_pending(residual: torch.Tensor, pending: Pending) -> None:
    """``residual`` = ``pending.rows`` if its flag is set, then the flag cleared (on the
    device: a graph replays it as it runs)."""
    if _kernels(residual.device.type) is not None:
        _kernels(residual.device.type).commit(residual, pending)
    else:
        torch.where(pending.flag.bool(), pending.rows, residual, out=residual)
    pending.flag.zero_()


def reduce_rows(received: torch.Tensor, rows: Rows, fmt: str, mean: bool,
                fused: bool | None = None) -> torch.Tensor:
    """The fp32 sum ``[m]`` (``mean``: divided by ``n``) of the ``n`` packed rows
    ``received``, dequantized (``dequantize_sum``)."""
    if uses_kernels(received, rows.block, fused):
        return _kernels(received.device.type).reduce(received, rows, fmt, mean, False)[0]
    reduced = dequantize_sum(received, fmt, rows.block, rows.m)
    return reduced.mul_(1 / rows.n) if mean else reduced  # as ``quantize``'s scale


def reduce_requantize(received: torch.Tensor, rows: Rows, fmt: str, mean: bool,
                      fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reduce_rows``'s row quantized again: (packed ``[1, rows.packed]``, what that
    dropped: the row minus the packed row dequantized, fp32 ``[m]``)."""
    if uses_kernels(received, rows.block, fused):
        dropped, mine = _kernels(received.device.type).reduce(received, rows, fmt, mean, True)
        return mine, dropped
    reduced = reduce_rows(received, rows, fmt, mean, fused=False)
    mine = quantize(reduced.unsqueeze(0), fmt, rows.block)
    return mine, reduced.sub_(dequantize(mine, fmt, rows.block, rows.m).view(rows.m))


def decode_into(out: torch.Tensor, packed: torch.Tensor, rows: Rows, fmt: str,
                fused: bool | None = None) -> None:
    """``out`` (``rows.numel`` elements, any float dtype) = the packed rows dequantized and
    joined (``Rows.join``)."""
    if uses_kernels(packed, rows.block, fused):
        _kernels(packed.device.type).decode_into(out, packed, rows, fmt)
    else:
        rows.join_into(out, dequantize(packed, fmt, rows.block, rows.m))
