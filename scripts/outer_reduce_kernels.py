"""GPU time of the compressed outer reduction's local work (quantize / dequantize), per
unit and per step (torch's eager kernels, what hsdp runs: on an H200 ``torch.compile``
of the same functions was slower, 1.36 against 1.15 ms per unit).

    python scripts/outer_reduce_kernels.py [--numel 27262976] [--outer 16] [--units 10]

One unit's inner shard of ``--numel`` elements (default: a Llama-8B layer, 218 M
parameters, over 8 inner ranks) over ``--outer`` ranks. hsdp's all-reduce runs per unit:
quantize the shard, its error (dequantize), dequantize-and-sum the received rows,
quantize the reduced row, dequantize the gathered rows; hfsdp's reduce-scatter the first
three. Times: CUDA events, median of ``--repeat`` after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from types import SimpleNamespace  # noqa: E402

from hsdp.sharding import quant  # noqa: E402


def _time(repeat: int, fn, *args) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=218_112_000 // 8)
    ap.add_argument("--outer", type=int, default=16)
    ap.add_argument("--units", type=int, default=10, help="units per step")
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = quant.Rows(args.numel, args.outer, args.block)
    x = torch.randn(args.numel, device=dev)
    eager = SimpleNamespace(quantize=quant.quantize, dequantize=quant.dequantize,
                            dequantize_sum=quant.dequantize_sum)
    print(f"numel {args.numel}, outer {args.outer}, block {args.block}, "
          f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    print("| dtype | kernels | quantize ms | dequantize ms | dequantize+sum ms | "
          "hsdp per unit ms | hfsdp per unit ms | hsdp per step ms | max diff vs eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in ("int8", "fp8_e4m3"):
        xr = rows.split(x)
        ref = eager.dequantize(eager.quantize(xr, fmt, args.block), fmt, args.block, rows.m)
        for name, k in (("eager", eager),):
            packed = k.quantize(xr, fmt, args.block)
            diff = (k.dequantize(packed, fmt, args.block, rows.m) - ref).abs().max().item()
            one = xr[:1].contiguous()
            r, b, m = args.repeat, args.block, rows.m
            q = _time(r, k.quantize, xr, fmt, b)
            dq = _time(r, k.dequantize, packed, fmt, b, m)
            ds = _time(r, k.dequantize_sum, packed, fmt, b, m)
            q1 = _time(r, k.quantize, one, fmt, b)
            hsdp_unit, hfsdp_unit = q + 2 * dq + ds + q1, q + dq + ds
            print(f"| {fmt} | {name} | {q:.3f} | {dq:.3f} | {ds:.3f} | {hsdp_unit:.3f} | "
                  f"{hfsdp_unit:.3f} | {hsdp_unit * args.units:.2f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
