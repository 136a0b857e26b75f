"""The compressed outer reduction's and gather's fused quantization passes on the meta
device, priced as the kernels run them (``hsdp.sharding.quant_kernels`` on CUDA): each
pass makes its outputs (empty meta tensors) and reports to the program being recorded
what it reads and writes, each input once and each output once
(``Program.kernel``). ``CostModel.quant_x_floor`` prices those bytes per pass: time over
the bytes at the card's copy bandwidth, as ``hsdp bench quant`` measures it (its
``x_floor``; a machine profile's, ``hsdp sim calibrate --quant``).

Without this the recording would count the eager ops' passes (``quant.py``'s CPU path:
several reads and writes of every element per pass).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hsdp.sharding import quant
from hsdp.sharding.quant import Keep, Pending, Rows
from hsdp_tools.sim.clock import Program

PASSES = ("encode", "reduce", "requant", "decode", "commit")


class MetaKernels:
    """``quant_kernels``' interface on meta tensors, reporting to ``program``."""

    MAX_BLOCK = 8192

    def __init__(self, program: Program) -> None:
        self.program = program

    def _report(self, name: str, *tensors: torch.Tensor | None) -> None:
        if self.program.issuing_side_op:
            self.program.kernel(name, sum(t.numel() * t.element_size()
                                          for t in tensors if t is not None))

    def encode(self, src: torch.Tensor, rows: Rows, fmt: str, residual: torch.Tensor | None,
               feedback: bool, pending: Pending | None = None, keep: Keep | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        packed = torch.empty(rows.n, rows.packed, dtype=torch.uint8, device=src.device)
        error = (pending.rows if pending is not None else
                 torch.empty(rows.n, rows.m, dtype=torch.float32, device=src.device)
                 if feedback else None)
        self._report("encode", src, residual, packed, error)
        return packed, error

    def reduce(self, received: torch.Tensor, rows: Rows, fmt: str, mean: bool,
               requantize: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.empty(rows.m, dtype=torch.float32, device=received.device)
        mine = (torch.empty(1, rows.packed, dtype=torch.uint8, device=received.device)
                if requantize else None)
        self._report("requant" if requantize else "reduce", received, out, mine)
        return out, mine

    def decode_into(self, out: torch.Tensor, packed: torch.Tensor, rows: Rows,
                    fmt: str) -> None:
        self._report("decode", packed, out)

    def commit(self, residual: torch.Tensor, pending: Pending) -> None:
        self._report("commit", residual, pending.rows)


@contextmanager
def fused_passes(program: Program) -> Iterator[None]:
    """While recording ``program``: the quantization passes on meta tensors run as
    ``MetaKernels``."""
    previous = quant.KERNELS.get("meta")
    quant.KERNELS["meta"] = MetaKernels(program)
    try:
        yield
    finally:
        if previous is None:
            quant.KERNELS.pop("meta", None)
        else:
            quant.KERNELS["meta"] = previous


def x_floor_from_bench(path: str | Path, fmt: str = "int8") -> dict[str, float]:
    """Per pass, the fused kernels' time over the copy floor in a ``bench quant`` JSON, at
    its per-step unit size (``--step-numel``; else its largest size): the bytes-weighted
    ratio over the rows of that size."""
    data = json.loads(Path(path).read_text())
    rows = [r for r in data["rows"] if r["path"] == "fused" and r["fmt"] == fmt]
    if not rows:
        raise ValueError(f"{path}: no fused {fmt} rows (run `hsdp bench quant`)")
    step = {s["numel"] for s in data.get("per_step", [])}
    sizes = {r["numel"] for r in rows}
    numel = max(step & sizes) if step & sizes else max(sizes)
    out = {}
    for name in PASSES:
        picked = [r for r in rows if r["numel"] == numel and r["pass"] == name]
        if picked:
            floor = sum(r["ms"] / r["x_floor"] for r in picked)
            out[name] = round(sum(r["ms"] for r in picked) / floor, 4)
    return out
