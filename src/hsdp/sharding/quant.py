"""Blockwise 8-bit quantization for the compressed outer reduction (pure tensor math: no
communication, no state).

A 1-D buffer of ``numel`` elements is cut into ``n`` rows of ``c = ceil(numel / n)``
elements (one per outer rank: the part that rank reduces), each zero-padded to ``m``
elements, a whole number of blocks. Each block of ``block`` elements is scaled by its
absolute maximum over the format's largest value (fp32 scale) and rounded to one byte
(int8: to nearest, ties to even; float8 e4m3: torch's cast). A row travels packed as
``m`` bytes of values followed by its scales' bytes, so one collective moves both.
"""

from __future__ import annotations

from dataclasses import dataclass

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


_SCALE_RANGE = {fmt: (_TINY, _largest_scale(qmax)) for fmt, (_, qmax) in _FORMATS.items()}


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
    scales are kept within ``_SCALE_RANGE`` (a denormal one would push ``|x| / scale``
    past the format, one near fp32's maximum would dequantize to inf); a block with a
    NaN or inf has a NaN or inf scale, so the whole block dequantizes non-finite."""
    dtype, qmax = _FORMATS[fmt]
    r, m = x.shape
    xb = x.view(r, m // block, block)
    scale = torch.linalg.vector_norm(xb, float("inf"), dim=-1, keepdim=True).div_(qmax)
    scale = torch.where(scale.isfinite(), scale.clamp(*_SCALE_RANGE[fmt]), scale)
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
    """The fp32 sum ``[m]`` of ``quantize``'s packed rows, dequantized."""
    return _scaled(packed, fmt, block, m).sum(dim=0).view(m)
