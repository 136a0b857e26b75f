"""bench collectives: argument parsing, row arithmetic, and one real 2x2 gloo job."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsdp_tools.bench.collectives import (
    VARIANTS,
    default_mesh,
    format_size,
    make_row,
    parse_max_ctas,
    parse_size,
    parse_sizes,
)
from hsdp_tools.bench.launch import check_shared_layout, shared_gpu
from hsdp.topology.communicators import NcclConfig
from hsdp_tools.report.args import parse_mesh

SRC = Path(__file__).resolve().parents[2] / "src"


def test_sizes():
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("256KiB") == 256 << 10
    assert parse_size("100") == parse_size("100B") == 100
    assert parse_sizes("64KiB, 256KiB,") == [64 << 10, 256 << 10]
    for bad in ("64MB", "1.5GiB", "MiB", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    assert [format_size(n) for n in (1 << 30, 3 << 20, 1536, 100)] == [
        "1GiB", "3MiB", "1536B", "100B"]


def test_mesh_and_max_ctas():
    assert parse_mesh("2x4") == (2, 4)
    assert parse_mesh("1X8") == (1, 8)
    for bad in ("2", "0x4", "2x4x1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mesh(bad)
    assert default_mesh(8) == (2, 4)
    assert default_mesh(1) == (1, 1)
    assert default_mesh(3) == (1, 3)
    assert parse_max_ctas("inner=8,outer=2") == {
        "inner_ag": NcclConfig(max_ctas=8), "inner_rs": NcclConfig(max_ctas=8),
        "outer": NcclConfig(max_ctas=2)}
    assert parse_max_ctas("outer=4") == {"outer": NcclConfig(max_ctas=4)}
    with pytest.raises(argparse.ArgumentTypeError):
        parse_max_ctas("middle=3")


def test_make_row_arithmetic():
    samples = {name: [2.0, 1.0, 3.0] for name in VARIANTS}
    samples.update(rs=[1.0, 2.0, 9.0], ar=[4.0, 3.0, 5.0], serial=[6.0, 8.0, 7.0],
                   overlap=[5.0, 4.0, 4.5], outer_rs=[1.0, 1.0, 1.0], hfsdp_pair=[3.0] * 3,
                   ag=[6.0] * 3, outer_ag=[2.0] * 3, fwd_pair=[9.0] * 3)
    row = make_row(1 << 20, samples)
    assert row["size_bytes"] == 1 << 20
    assert (row["t_rs_ms"], row["t_rs_min_ms"], row["t_rs_max_ms"]) == (2.0, 1.0, 9.0)
    assert row["t_ar_ms"] == 4.0 and row["t_serial_ms"] == 7.0 and row["t_overlap_ms"] == 4.5
    assert row["saving_pct"] == pytest.approx(100 * (1 - 4.5 / 7.0))
    assert row["overlap_over_max"] == pytest.approx(4.5 / 4.0)
    assert row["hfsdp_pair_over_max"] == pytest.approx(3.0 / 2.0)
    assert row["fwd_pair_over_max"] == pytest.approx(9.0 / 6.0)


def bench_collectives(*argv: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1",
           "NCCL_LAUNCH_ORDER_IMPLICIT": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # spawn its own ranks, as outside torchrun
    return subprocess.run([sys.executable, "-m", "hsdp", "bench", "collectives", *argv],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.full
def test_bench_collectives_cli_writes_json(tmp_path):
    out = tmp_path / "collectives.json"
    proc = bench_collectives("--nproc", "4", "--mesh", "2x2", "--sizes", "64KiB,256KiB",
                             "--iters", "3", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "saving %" in proc.stdout
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert (meta["outer"], meta["inner"], meta["world"]) == (2, 2, 4)
    assert meta["dtype"] == "fp32" and meta["backend"] == "gloo" and meta["iters"] == 3
    assert meta["torch"] and meta["date"]
    assert meta["env"]["NCCL_LAUNCH_ORDER_IMPLICIT"] == "1"  # recorded, on or off
    assert meta["layout"] == "one rank per device"
    rows = result["rows"]
    assert [r["size_bytes"] for r in rows] == [64 << 10, 256 << 10]
    for row in rows:
        for name in VARIANTS:
            lo, mid, hi = (row[f"t_{name}_min_ms"], row[f"t_{name}_ms"],
                           row[f"t_{name}_max_ms"])
            assert 0 < lo <= mid <= hi, (name, row)
        for key in ("saving_pct", "overlap_over_max", "hfsdp_pair_over_max",
                    "fwd_pair_over_max"):
            assert isinstance(row[key], float)


def test_shared_gpu_layout_keeps_every_communicator_on_distinct_gpus():
    for (outer, inner), gpus in (((2, 2), 2), ((2, 4), 4), ((4, 4), 4), ((1, 2), 2)):
        place = [[shared_gpu(o * inner + i, inner, gpus) for i in range(inner)]
                 for o in range(outer)]
        for row in place:  # inner groups
            assert len(set(row)) == inner, (outer, inner, place)
        for col in zip(*place, strict=True):  # outer groups
            assert len(set(col)) == outer, (outer, inner, place)
        check_shared_layout("test", outer, inner, gpus)
    assert [shared_gpu(r, 2, 2) for r in range(4)] == [0, 1, 1, 0]  # docs/design.md's recipe
    with pytest.raises(SystemExit, match="outer and inner <= the number of GPUs"):
        check_shared_layout("test", 2, 4, 2)


@pytest.mark.full
def test_shared_links_put_the_outer_communicator_on_the_inner_ranks(tmp_path):
    out = tmp_path / "collectives.json"
    proc = bench_collectives("--nproc", "2", "--mesh", "1x2", "--shared-links", "--sizes",
                             "64KiB", "--iters", "2", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "outer communicator over the inner ranks" in proc.stdout
    result = json.loads(out.read_text())
    assert result["meta"]["shared_links"] is True
    assert result["meta"]["links"].startswith("shared")
    (row,) = result["rows"]
    assert row["t_ar_ms"] > 0 and row["t_overlap_ms"] > 0 and row["t_hfsdp_pair_ms"] > 0
    bad = bench_collectives("--nproc", "4", "--mesh", "2x2", "--shared-links", timeout=60)
    assert bad.returncode != 0 and "--shared-links needs a 1xN mesh" in bad.stderr
