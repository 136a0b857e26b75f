"""bench step --float8 on one process emulating a 2x4 mesh (CPU): hsdp's inner all-gathers
move what fp32 moves less 3 bytes per float8 weight element and gather, as FSDP2's (up to
padding); without torchao the option says how to install it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Llama of hidden 32 and vocab 64: every linear float8; embedding and norms fp32
TINY = ["--emulate", "--arch", "llama", "--layers", "2", "--hidden", "32", "--heads", "2",
        "--kv-heads", "1", "--ffn", "64", "--vocab", "64", "--seq", "16", "--steps", "1",
        "--warmup", "1", "--record-steps", "1", "--trace-steps", "1",
        "--schedules", "overlap,fsdp2"]
INNER = 4  # bench step's emulated CPU mesh: 2x4


def bench_step(*argv: str, first_on_path: Path | None = None
               ) -> subprocess.CompletedProcess:
    path = [str(p) for p in (first_on_path, SRC) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hsdp", "bench", "step", "--device", "cpu",
                           *argv], env=env, capture_output=True, text=True, timeout=300)


def _bytes(tmp_path: Path, *extra: str) -> dict[str, dict[str, int]]:
    out = tmp_path / "_".join(extra or ("fp32",))
    proc = bench_step(*TINY, *extra, "--json", str(out / "r.json"), "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "r.json").read_text())
    return {k: s["collective_bytes_per_step"] for k, s in result["schedules"].items()}


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs hsdp[float8]")
@pytest.mark.full
def test_bench_step_float8_halves_all_gather_bytes(tmp_path: Path) -> None:
    fp32, float8 = _bytes(tmp_path), _bytes(tmp_path, "--float8")
    # FSDP2 moves the same bytes but for its padding (rows, not hsdp's 16 elements)
    for kind, n in float8["overlap"].items():
        assert abs(float8["fsdp2"][kind] - n) <= 0.01 * n, (float8, kind)
    # every linear is float8: the blocks' wq, wo (32x32), wk, wv (16x32), w1, w3, w2
    # (32x64), gathered in forward and again in backward; the head (32x64) in the root,
    # gathered once
    per_block = 2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64
    saved = fp32["overlap"]["all_gather:inner"] - float8["overlap"]["all_gather:inner"]
    assert saved == 3 * (2 * per_block * 2 + 32 * 64), (fp32, float8)
    # gradients stay in the reduce dtype: float8 changes no reduction
    assert fp32["overlap"]["reduce_scatter:inner"] == float8["overlap"]["reduce_scatter:inner"]


@pytest.mark.full
def test_bench_step_float8_without_torchao_says_how_to_install(tmp_path: Path) -> None:
    hide = tmp_path / "hide"
    (hide / "torchao").mkdir(parents=True)
    (hide / "torchao" / "__init__.py").write_text("raise ImportError('hidden')\n")
    proc = bench_step(*TINY, "--float8", first_on_path=hide)
    assert proc.returncode != 0
    assert "hsdp[float8]" in proc.stderr, proc.stderr[-2000:]
