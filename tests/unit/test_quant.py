"""Blockwise 8-bit quantization (``sharding/quant.py``) and ``hsdp.OuterReduce``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hsdp
from hsdp.sharding.quant import Rows, dequantize, quantize


@pytest.mark.parametrize("numel,n,block", [(100, 4, 16), (64, 2, 16), (1000, 3, 128),
                                           (5, 8, 16)])
def test_rows_split_join_round_trip(numel: int, n: int, block: int) -> None:
    rows = Rows(numel, n, block)
    x = torch.randn(numel)
    r = rows.split(x)
    assert r.shape == (n, rows.m) and rows.m % block == 0 and rows.m >= rows.c
    assert torch.equal(rows.join(r), x)
    assert r.abs().sum() == pytest.approx(x.abs().sum().item())  # padding is zeros


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_quantize_error_is_bounded_per_block(fmt: str) -> None:
    torch.manual_seed(0)
    block = 32
    x = torch.randn(3, 4 * block) * torch.logspace(-6, 3, 4).repeat_interleave(block)
    packed = quantize(x, fmt, block)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 4 * block + 4 * 4)
    y = dequantize(packed, fmt, block, 4 * block)
    amax = x.view(3, 4, block).abs().amax(-1, keepdim=True)
    err = (y - x).view(3, 4, block).abs()
    if fmt == "int8":  # rounding to the nearest of 255 levels
        assert (err <= amax / 127 / 2 * (1 + 1e-5)).all()
    else:  # 3 mantissa bits: half an ulp, or the subnormal step near zero
        xb = x.view(3, 4, block).abs()
        assert (err <= torch.maximum(xb * 2**-4, amax / 448 * 2**-10) * (1 + 1e-5)).all()
    assert err.amax() > 0  # it did quantize


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_quantize_zeros_and_block_maximum_are_exact(fmt: str) -> None:
    x = torch.zeros(2, 32)
    x[1, 5] = -3.5
    y = dequantize(quantize(x, fmt, 16), fmt, 16, 32)
    assert torch.equal(y, x)


def test_blocks_at_the_ends_of_fp32_dequantize_finite_and_no_farther_than_zero() -> None:
    """A finite block never dequantizes to inf (fp32's maximum: int8's scale rounded up
    did), and no value lands farther from itself than zero is (a block of subnormals: a
    subnormal scale put ``|x| / scale`` past 127, where int8 wraps around)."""
    for fmt in ("int8", "fp8_e4m3"):
        for amax in (torch.finfo(torch.float32).max, 2.7e-43, 9.4e-43):
            x = torch.zeros(1, 16)
            x[0, :3] = torch.tensor([amax, -amax / 3, amax / 7])
            y = dequantize(quantize(x, fmt, 16), fmt, 16, 16)
            assert y.isfinite().all(), (fmt, amax)
            assert ((y - x).abs() <= x.abs()).all(), (fmt, amax)


def test_outer_reduce_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        hsdp.OuterReduce("int4")
    for block in (0, 24, 2**17, 8, True):
        with pytest.raises(ValueError, match="does not divide"):
            hsdp.OuterReduce("int8", block=block)
    with pytest.raises(TypeError, match="error_feedback"):
        hsdp.OuterReduce("int8", error_feedback=1)
    assert hsdp.OuterReduce("fp8_e4m3", block=64).block == 64


@pytest.mark.parametrize("numel,n", [(64, 4), (100, 4)])
def test_rows_join_into_equals_join(numel: int, n: int) -> None:
    rows = Rows(numel, n, 16)
    r = rows.split(torch.randn(numel))
    out = torch.empty(numel)
    rows.join_into(out, r)
    assert torch.equal(out, rows.join(r))


def test_outer_reduce_needs_an_all_to_all_on_the_outer_communicator() -> None:
    """Fault tolerance (torchft's replica-group communicator) and an outer backend not
    known to have all-to-all are refused (``fully_shard`` checks before it builds
    anything)."""
    from types import SimpleNamespace

    from hsdp.ft.outer import FaultToleranceError

    cpu = torch.device("cpu")

    def _check_outer_reduce(comms: SimpleNamespace, device: torch.device) -> None:
        hsdp.OuterReduce().check_shard(hsdp.Strategy.HSDP, comms, device, [], [])

    with pytest.raises(FaultToleranceError, match="not supported with fault tolerance"):
        _check_outer_reduce(SimpleNamespace(elastic=object(), outer_size=2), cpu)

    class Backend:
        def __init__(self, name: str) -> None:
            self._name = name

        def name(self) -> str:
            return self._name

    def comms(name: str) -> SimpleNamespace:
        return SimpleNamespace(elastic=None, outer_size=2,
                               outer=SimpleNamespace(_get_backend=lambda _d: Backend(name)))

    with pytest.raises(ValueError, match="backend 'custom' is not one known to have it"):
        _check_outer_reduce(comms("custom"), cpu)
    _check_outer_reduce(comms("gloo"), cpu)  # no error


def test_outer_reduce_short_form() -> None:
    from hsdp.runtime.outer_modes import as_mode

    def as_outer_reduce(value: object) -> hsdp.OuterReduce | None:
        return as_mode("outer_reduce", value)

    assert as_outer_reduce("fp8_e4m3:64") == hsdp.OuterReduce("fp8_e4m3", 64)
    assert as_outer_reduce("int8") == hsdp.OuterReduce()
    assert as_outer_reduce("none") is None and as_outer_reduce(None) is None
    with pytest.raises(ValueError, match="expected none or DTYPE"):
        as_outer_reduce("int8:x")
    with pytest.raises(TypeError, match="short form"):
        as_outer_reduce(8)


_INTERPRETED = """
import torch
from hsdp.sharding import quant, quant_kernels as k
from hsdp.sharding.compressed import LIMIT
torch.manual_seed(0)
for numel, n, block, mean in [(1000, 3, 16, True), (5, 8, 16, False), (4096, 4, 256, True)]:
    rows = quant.Rows(numel, n, block)
    src = torch.randn(numel) * torch.logspace(-3, 3, numel)
    residual = torch.randn(n, rows.m) * 0.01
    for a, b in zip(k.encode(src, rows, "int8", residual, True),
                    quant.encode(src, rows, "int8", residual, True, fused=False)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), ("encode", numel)
    received = quant.encode(src, rows, "int8", fused=False)[0].roll(1, 0)
    reduced = k.reduce(received, rows, "int8", mean, False)[0]
    assert torch.equal(reduced, quant.reduce_rows(received, rows, "int8", mean, fused=False))
    dropped, mine = k.reduce(received, rows, "int8", mean, True)
    ref_mine, ref_dropped = quant.reduce_requantize(received, rows, "int8", mean, fused=False)
    assert torch.equal(mine, ref_mine) and torch.equal(dropped, ref_dropped), ("requant", numel)
    out, ref = torch.full((numel,), float("nan")), torch.empty(numel)
    k.decode_into(out, received, rows, "int8")
    quant.decode_into(ref, received, rows, "int8", fused=False)
    assert torch.equal(out, ref), ("decode", numel)
    bad = src.clone()
    bad[0], bad[-1] = float("nan"), 1e30  # the first block NaN, the last past the limit
    for res, flag in ((residual, None), (None, None), (residual, 0), (residual, 1)):
        for keep in (quant.Keep(LIMIT), quant.Keep(LIMIT, unchecked=n - 1)):
            def run(fused):  # flag: fixed buffers (CUDA graphs), the pending one set or not
                pending = None if flag is None else quant.Pending(
                    residual * 0.5, torch.tensor([flag], dtype=torch.int32))
                if fused:
                    return k.encode(bad, rows, "int8", res, True, pending, keep)[1]
                return quant.encode(bad, rows, "int8", res, True, fused=False,
                                    pending=pending, keep=keep)[1]
            got, want = run(True), run(False)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            assert got[0].isfinite().all(), ("keep", numel, keep, flag)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_fused_kernels_equal_eager_in_tritons_interpreter() -> None:
    """The Triton kernels' indexing and arithmetic on CPU (Triton's interpreter, int8 and
    fp32 only: it has no float8 and casts bf16 otherwise than CUDA): bit-identical to the
    eager ops. tests/gpu/test_quant_kernels.py checks every format and dtype on CUDA."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


class _Echo:
    """The outer collectives as if every rank sent what this one sends."""

    def all_to_all(self, out, inp, group, axis):
        out.copy_(inp)

    def all_gather(self, out, inp, group, axis):
        n = out.numel() // inp.numel()
        out.view(n, -1).copy_(inp.reshape(1, -1).expand(n, -1))


@pytest.mark.parametrize("hfsdp", [False, True])
def test_compressed_residual_in_fixed_buffers_equals_swapped(hfsdp: bool) -> None:
    """CUDA graphs' fixed residual buffers (``make_static``: pending chosen by a device
    flag, committed by a copy) give the host-swapped residual's results bit for bit:
    chained backwards, a commit, a drop of pending gradients, a step without feedback
    committed twice, a loaded residual; and no buffer is replaced once static."""
    from hsdp.sharding.compressed import CompressedOuter

    cfg = hsdp.OuterReduce("int8", block=16)
    units = [CompressedOuter(cfg, 1000, 4, 1, torch.device("cpu")) for _ in range(2)]
    reduce = "reduce_scatter" if hfsdp else "all_reduce"
    c = Rows(1000, 4, 16).c
    gen = torch.Generator().manual_seed(0)

    def backward(step: int) -> list[torch.Tensor]:
        src = torch.randn(1000, generator=gen) * (1 + step)
        outs = [torch.empty(c if hfsdp else 1000) for _ in units]
        for u, out in zip(units, outs):
            getattr(u, reduce)(_Echo(), out, src.clone(), None, avg=True)
        return outs

    backward(0)
    for u in units:
        u.commit()
    units[1].make_static()
    buffers = (units[1].residual, units[1]._static.rows)
    script = ["b", "b", "c", "b", "d", "b", "c", "c", "b", "b", "c", "l", "b", "c"]
    for step, what in enumerate(script):
        if what == "b":
            a, b = backward(step)
            assert torch.equal(a, b), (step, what)
        loaded = units[0].residual_flat() * 0.5
        for u in units:
            if what == "c":
                u.commit()
            elif what == "d":
                u.drop()
            elif what == "l":
                u.load_residual(loaded)
        assert torch.equal(units[0].residual_flat(), units[1].residual_flat()), (step, what)
    assert (units[1].residual, units[1]._static.rows) == buffers
