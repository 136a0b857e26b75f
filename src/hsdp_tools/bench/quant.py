"""Quantization kernels bench: ms per pass and GB/s of the compressed outer reduction's
local work (``sharding/quant.py``), fused Triton kernels beside the eager ops.

One unit: an inner shard of SIZE bytes of fp32 gradient (``--sizes``) over ``--outer``
ranks (rows), block ``--block``, error feedback on. The passes, as the outer reduction
runs them:

- ``encode``: residual add, block maxima, scale, round, pack, and the new error-feedback
  residual (reads the shard and the residual; writes the packed rows and the residual);
- ``reduce``: the ``n`` received rows dequantized and summed in fp32, the mean (hfsdp's
  reduce-scatter);
- ``requant``: the same, the sum quantized again and what that dropped (hsdp's
  all-reduce, before its all-gather);
- ``decode``: the ``n`` gathered rows dequantized into the fp32 gradient (hsdp's).

Per unit: hsdp = encode + requant + decode, hfsdp = encode + reduce. Bytes: what the pass
must read and write, each input read once and each output written once. ``floor``: the
bytes over the card's copy bandwidth (a device-to-device copy of 1 GiB measured in the
same run, bytes read + written); ``x floor`` = time / floor (target: at most 2).

Paths: ``fused`` (``hsdp/sharding/quant_kernels.py``, what runs on CUDA), ``eager`` (the
torch ops, the CPU path and the reference; each fused result is checked equal to it bit for bit, the
``identical`` column), ``compile`` (``torch.compile`` of the eager passes, int8, at the
``--compile-sizes`` only: each size compiles anew), ``torchft`` (``torchft.quantization``:
fp8, one fp32 scale per row of a 2-D tensor, here ``[numel / --torchft-cols, cols]``, no
error feedback: ``fused_quantize_into_fp8`` as encode, ``fused_reduce_fp8`` as requant,
``fused_dequantize_from_fp8`` as decode; ``--torchft FILE`` loads its ``quantization.py``
where the package is not installed). Times: ``triton.testing.do_bench`` (CUDA events, L2
flushed before each call), median. ``--step-numel`` x ``--units``: the per-step kernel ms of
a model whose units have that many elements per rank (default: 8 Llama-8B layers over 8
inner ranks, 16 outer), from a row measured at that size.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import platform
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from hsdp.sharding import quant
from hsdp.sharding.quant import Rows
from hsdp_tools.bench.collectives import parse_sizes
from hsdp_tools.report.table import print_table

PASSES = ("encode", "reduce", "requant", "decode")
LLAMA8B_LAYER = 218_103_808  # parameters of one Llama-3-8B block


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB,256MiB",
                   help="unit sizes, bytes of fp32 gradient (comma separated)")
    p.add_argument("--outer", type=int, default=16, help="outer ranks: rows per unit")
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--formats", default="int8,fp8_e4m3")
    p.add_argument("--paths", default="fused,eager,compile,torchft")
    p.add_argument("--step-numel", type=int, default=LLAMA8B_LAYER // 8,
                   help="elements per unit and rank of the per-step estimate")
    p.add_argument("--units", type=int, default=8, help="units per step of the estimate")
    p.add_argument("--compile-sizes", default="step",
                   help="sizes for torch.compile ('step': --step-numel's)")
    p.add_argument("--torchft", type=Path, default=None,
                   help="torchft's quantization.py, where torchft is not installed")
    p.add_argument("--torchft-cols", type=int, default=4096)
    p.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("bench quant: needs a CUDA GPU")
    torch.manual_seed(0)
    paths = args.paths.split(",")
    numels = [s // 4 for s in parse_sizes(args.sizes)]
    if args.step_numel not in numels:
        numels.append(args.step_numel)
    compile_at = ({args.step_numel} if args.compile_sizes == "step"
                  else {s // 4 for s in parse_sizes(args.compile_sizes)})
    copy_gbps = _copy_gbps()
    torchft = _torchft(args.torchft) if "torchft" in paths else None
    rows: list[dict] = []
    for numel in numels:
        for fmt in args.formats.split(","):
            unit = _Unit(numel, args.outer, args.block, fmt)
            for path in paths:
                if path == "compile" and (fmt != "int8" or numel not in compile_at):
                    continue
                if path == "torchft" and (torchft is None or fmt != "fp8_e4m3"):
                    continue
                rows += unit.measure(path, copy_gbps, torchft, args.torchft_cols)
    result = {"meta": _meta(args, copy_gbps), "rows": rows,
              "per_step": _per_step(rows, args.step_numel, args.units)}
    _print(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


class _Unit:
    """One unit's inputs (random, per-block magnitudes spread over decades) and passes."""

    def __init__(self, numel: int, n: int, block: int, fmt: str) -> None:
        dev = torch.device("cuda")
        self.rows, self.fmt, self.numel = Rows(numel, n, block), fmt, numel
        spread = torch.logspace(-4, 2, 97, device=dev)
        self.src = torch.randn(numel, device=dev) * spread[torch.arange(numel, device=dev)
                                                           // block % 97]
        self.residual = torch.randn(n, self.rows.m, device=dev) * 1e-3
        self.received = torch.stack([quant.encode(self.src, self.rows, fmt, fused=False)[0][i]
                                     for i in range(n)][::-1])
        self.out = torch.empty(numel, device=dev)

    def passes(self, fused: bool, out: torch.Tensor | None = None
               ) -> dict[str, Callable[[], object]]:
        """Each pass as a call (``decode`` into ``out``, default the unit's own)."""
        r, f = self.rows, self.fmt
        return {"encode": partial(quant.encode, self.src, r, f, self.residual, True, fused),
                "reduce": partial(quant.reduce_rows, self.received, r, f, True, fused),
                "requant": partial(quant.reduce_requantize, self.received, r, f, True, fused),
                "decode": partial(self._decode, fused, self.out if out is None else out)}

    def _decode(self, fused: bool, out: torch.Tensor) -> torch.Tensor:
        quant.decode_into(out, self.received, self.rows, self.fmt, fused)
        return out

    def bytes(self, name: str) -> int:
        n, m, p = self.rows.n, self.rows.m, self.rows.packed
        return {"encode": 4 * self.numel + 4 * n * m + n * p + 4 * n * m,
                "reduce": n * p + 4 * m, "requant": n * p + p + 4 * m,
                "decode": n * p + 4 * self.numel}[name]

    def measure(self, path: str, copy_gbps: float, torchft, cols: int) -> list[dict]:
        if path == "torchft":
            return self._torchft(torchft, cols, copy_gbps)
        fns = self.passes(path == "fused")
        if path == "compile":
            fns = {k: torch.compile(fn) for k, fn in fns.items()}
        same = (_identical(self.passes(True, torch.empty_like(self.out)),
                           self.passes(False, torch.empty_like(self.out)))
                if path == "fused" else {})
        return [self._row(path, name, fn, self.bytes(name), copy_gbps, same.get(name))
                for name, fn in fns.items()]

    def _row(self, path: str, name: str, fn: Callable[[], object], nbytes: int,
             copy_gbps: float, identical: bool | None) -> dict:
        ms = _bench(fn)
        return {"numel": self.numel, "mib": self.numel * 4 / 2**20, "outer": self.rows.n,
                "block": self.rows.block, "fmt": self.fmt, "path": path, "pass": name,
                "ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6,
                "x_floor": ms / (nbytes / copy_gbps / 1e6), "identical": identical}

    def _torchft(self, ft, cols: int, copy_gbps: float) -> list[dict]:
        n = self.rows.n
        x = self.src[: self.numel // cols * cols].view(-1, cols)
        q = ft.fused_quantize_into_fp8([x], n)
        out, packed = torch.empty_like(x), q.numel()
        fns = {"encode": (lambda: ft.fused_quantize_into_fp8([x], n), 4 * x.numel() + packed),
               "requant": (lambda: ft.fused_reduce_fp8([x], q, n, 0), packed + packed // n),
               "decode": (lambda: ft.fused_dequantize_from_fp8([out], q, n),
                          packed + 4 * x.numel())}
        rows = [self._row("torchft", k, fn, b, copy_gbps, None) for k, (fn, b) in fns.items()]
        for row in rows:
            row["block"] = cols
        return rows


def _identical(fused: dict, eager: dict) -> dict[str, bool]:
    """Per pass: the fused results equal the eager ones bit for bit."""
    def bits(v: object) -> list[torch.Tensor]:
        items = v if isinstance(v, tuple) else (v,)
        return [t.view(torch.uint8) for t in items if t is not None]
    return {k: all(torch.equal(a, b) for a, b in zip(bits(fused[k]()), bits(eager[k]()),
                                                     strict=True)) for k in fused}


def _bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _copy_gbps() -> float:
    a = torch.empty(2**28, device="cuda")
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a))
    return 2 * a.numel() * 4 / ms / 1e6


def _torchft(path: Path | None):
    """``torchft.quantization`` (or the file ``path``), None where neither loads."""
    try:
        return importlib.import_module("torchft.quantization")
    except ImportError:
        if path is None or not path.is_file():
            return None
    spec = importlib.util.spec_from_file_location("torchft_quantization", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _per_step(rows: list[dict], numel: int, units: int) -> list[dict]:
    """hsdp / hfsdp kernel ms per unit and per step of ``units`` units of ``numel``."""
    out = []
    for fmt in sorted({r["fmt"] for r in rows}):
        for path in ("fused", "eager", "compile", "torchft"):
            ms = {r["pass"]: r["ms"] for r in rows
                  if (r["numel"], r["fmt"], r["path"]) == (numel, fmt, path)}
            for schedule, parts in (("hsdp", ("encode", "requant", "decode")),
                                    ("hfsdp", ("encode", "reduce"))):
                if all(p in ms for p in parts):
                    unit = sum(ms[p] for p in parts)
                    out.append({"fmt": fmt, "path": path, "schedule": schedule,
                                "unit_ms": unit, "step_ms": unit * units,
                                "numel": numel, "units": units})
    return out


def _meta(args: argparse.Namespace, copy_gbps: float) -> dict:
    import triton

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "host": platform.node(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "copy_gbps": copy_gbps,
            "outer": args.outer, "block": args.block}


def _print(result: dict) -> None:
    meta = result["meta"]
    rows = [[f"{r['mib']:.1f}", r["fmt"], r["pass"], r["path"], f"{r['ms']:.4f}",
             f"{r['gbps']:.0f}", f"{r['x_floor']:.2f}",
             "" if r["identical"] is None else str(r["identical"]).lower()]
            for r in result["rows"]]
    print_table(f"quantization kernels: {meta['gpu']}, outer {meta['outer']}, block "
                f"{meta['block']}, copy {meta['copy_gbps']:.0f} GB/s",
                ["MiB", "format", "pass", "path", "ms", "GB/s", "x floor", "identical"], rows)
    steps = [[s["fmt"], s["path"], s["schedule"], f"{s['unit_ms']:.3f}",
              f"{s['step_ms']:.2f}"] for s in result["per_step"]]
    print_table(f"per step: {result['per_step'][0]['units'] if steps else 0} units of "
                f"{result['per_step'][0]['numel'] if steps else 0} elements",
                ["format", "path", "schedule", "ms per unit", "ms per step"], steps)
