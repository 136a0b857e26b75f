"""The fused Triton quantization kernels (``sharding/quant_kernels.py``) against the eager
ops on the same GPU, bit for bit (skipped without CUDA or triton)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hsdp.sharding import quant
from hsdp.sharding.quant import Rows

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA GPU and triton")
FORMATS = ("int8", "fp8_e4m3")
# (numel, outer rows, block): ragged last rows, empty rows, one row, large blocks
SHAPES = [(100_003, 3, 16), (5, 8, 16), (1 << 20, 16, 256), (262_147, 4, 4096),
          (70_000, 1, 8192)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    diff = (_bits(a) != _bits(b)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"


def _gradient(numel: int, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values whose blocks span 60 decades (subnormal to 1e30), with zero blocks,
    blocks of one value and blocks of exact halves (rounding ties)."""
    g = torch.randn(numel, device="cuda", dtype=torch.float64)
    blocks = torch.arange(numel, device="cuda") // block
    g *= torch.logspace(-40, 30, 29, device="cuda", dtype=torch.float64)[blocks % 29]
    g[blocks % 31 == 3] = 0.0
    g[blocks % 37 == 5] = -2.5
    halves = blocks % 41 == 7
    g[halves] = (torch.arange(int(halves.sum()), device="cuda") % 255 - 127 + 0.5).double()
    return g.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel,n,block", SHAPES)
@pytest.mark.parametrize("case", ["residual", "fp32", "bf16", "no_feedback"])
def test_encode_equals_eager(fmt: str, numel: int, n: int, block: int, case: str) -> None:
    torch.manual_seed(numel + n + block)
    rows = Rows(numel, n, block)
    src = _gradient(numel, block, torch.bfloat16 if case == "bf16" else torch.float32)
    residual = (_gradient(n * rows.m, block) * 1e-3).view(n, rows.m) if case == "residual" \
        else None
    feedback = case != "no_feedback"
    packed, error = quant.encode(src, rows, fmt, residual, feedback, fused=True)
    ref_packed, ref_error = quant.encode(src, rows, fmt, residual, feedback, fused=False)
    _assert_same(packed, ref_packed)
    if feedback:
        _assert_same(error, ref_error)
    else:
        assert error is None and ref_error is None


def _received(rows: Rows, fmt: str) -> torch.Tensor:
    """``n`` packed rows as an all-to-all delivers them: each from another rank's data."""
    return torch.cat([quant.encode(_gradient(rows.numel, rows.block) * (1 + r), rows, fmt,
                                   fused=False)[0][r:r + 1] for r in range(rows.n)])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel,n,block", SHAPES)
@pytest.mark.parametrize("mean", [True, False])
def test_reduce_and_requantize_equal_eager(fmt: str, numel: int, n: int, block: int,
                                           mean: bool) -> None:
    torch.manual_seed(numel * 7 + n)
    rows = Rows(numel, n, block)
    received = _received(rows, fmt)
    _assert_same(quant.reduce_rows(received, rows, fmt, mean, fused=True),
                 quant.reduce_rows(received, rows, fmt, mean, fused=False))
    mine, dropped = quant.reduce_requantize(received, rows, fmt, mean, fused=True)
    ref_mine, ref_dropped = quant.reduce_requantize(received, rows, fmt, mean, fused=False)
    _assert_same(mine, ref_mine)
    _assert_same(dropped, ref_dropped)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel,n,block", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_equals_eager(fmt: str, numel: int, n: int, block: int,
                                  dtype: torch.dtype) -> None:
    rows = Rows(numel, n, block)
    received = _received(rows, fmt)
    out, ref = (torch.full((numel,), float("nan"), device="cuda", dtype=dtype)
                for _ in range(2))
    quant.decode_into(out, received, rows, fmt, fused=True)
    quant.decode_into(ref, received, rows, fmt, fused=False)
    _assert_same(out, ref)
    assert not out.isnan().any()  # every element written


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_blocks_keep_their_scales(fmt: str) -> None:
    """A block holding NaN or inf gets the eager path's scale (NaN / inf) and a non-finite
    error wherever the eager error is; the other blocks stay bit-identical."""
    rows = Rows(4096, 2, 64)
    src = _gradient(4096, 64)
    src[70], src[64 * 9 + 3], src[2048 + 64 * 5] = float("nan"), float("inf"), -float("inf")
    packed, error = quant.encode(src, rows, fmt, None, True, fused=True)
    ref_packed, ref_error = quant.encode(src, rows, fmt, None, True, fused=False)
    scales, ref_scales = (p[:, rows.m:].contiguous().view(torch.float32)
                          for p in (packed, ref_packed))
    assert torch.equal(scales.isnan(), ref_scales.isnan()) and scales.isnan().any()
    assert torch.equal(scales.nan_to_num(0.0), ref_scales.nan_to_num(0.0))
    bad = ~ref_error.isfinite()
    assert torch.equal(~error.isfinite(), bad) and bad.any()
    finite_blocks = bad.view(2, -1, 64).any(-1, keepdim=True).logical_not().expand(-1, -1, 64)
    _assert_same(error.view(2, -1, 64)[finite_blocks], ref_error.view(2, -1, 64)[finite_blocks])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("base", ["none", "residual", "pending_unset", "pending_set"])
@pytest.mark.parametrize("unchecked", [-1, 1])
def test_kept_blocks_equal_eager(fmt: str, base: str, unchecked: int) -> None:
    """``quant.Keep`` in the encode pass: blocks of the error with a NaN, an inf or a
    value past the limit take the base's values (the residual, zeros without one; with
    fixed buffers the committed residual, whichever the flag read), row ``unchecked``
    left as it is; equal to the eager ops, NaNs in place."""
    from hsdp.sharding.compressed import LIMIT

    rows = Rows(4096, 2, 64)
    src = _gradient(4096, 64)
    src[70], src[64 * 9 + 3], src[2048 + 64 * 5], src[2048 + 64 * 7] = (
        float("nan"), float("inf"), -float("inf"), 1e30)
    residual = None if base == "none" else (_gradient(2 * rows.m, 64) * 1e-3).view(2, rows.m)
    keep = quant.Keep(LIMIT, unchecked)

    def run(fused: bool) -> torch.Tensor:
        pending = None
        if base.startswith("pending"):
            pending = quant.Pending(residual * 0.5, torch.tensor(
                [int(base == "pending_set")], dtype=torch.int32, device="cuda"))
        return quant.encode(src, rows, fmt, residual, True, fused=fused, pending=pending,
                            keep=keep)[1]

    got, want = run(True), run(False)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got[0].isfinite().all() and got[1].isfinite().all() == (unchecked != 1)


def test_dispatch_takes_the_kernels_on_cuda_only() -> None:
    cuda, cpu = torch.empty(1, device="cuda"), torch.empty(1)
    assert quant.uses_kernels(cuda, 256) and not quant.uses_kernels(cpu, 256)
    assert not quant.uses_kernels(cuda, 16384)  # blocks over one tile: eager
    assert not quant.uses_kernels(cuda, 256, fused=False)
    with pytest.raises(RuntimeError, match="need a CUDA tensor"):
        quant.uses_kernels(cpu, 256, fused=True)


class _LoopbackCollectives:
    """One outer rank: the all-to-all and all-gather deliver this rank's own rows."""

    def all_to_all(self, out: torch.Tensor, src: torch.Tensor, group, label) -> None:
        out.copy_(src)

    all_gather = all_to_all


@pytest.mark.parametrize("strategy", ["all_reduce", "reduce_scatter"])
def test_compressed_reduction_equals_eager_with_error_feedback(monkeypatch, strategy) -> None:
    """``CompressedOuter`` over three steps (the residual carried by ``commit``): the
    reduced gradients and the residual with the kernels equal those of the eager ops."""
    from hsdp.sharding.compressed import CompressedOuter
    from hsdp.sharding.outer_reduce import OuterReduce

    def steps(kernels: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(quant, "uses_kernels",
                            lambda t, block, fused=None: kernels)
        torch.manual_seed(3)
        c = CompressedOuter(OuterReduce("int8", 128), 10_001, 1, 0, torch.device("cuda"))
        outs = []
        for _ in range(3):
            out = torch.empty(10_001, device="cuda")
            getattr(c, strategy)(_LoopbackCollectives(), out, _gradient(10_001, 128), None,
                                 avg=True)
            c.commit()
            outs += [out, c.residual_flat()]
        return outs

    for a, b in zip(steps(True), steps(False), strict=True):
        _assert_same(a, b)
