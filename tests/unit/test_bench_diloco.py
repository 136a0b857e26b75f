"""``python -m hsdp bench diloco`` on a tiny run (mesh 2x2, one block, one step per row):
rows without communication report no outer bytes, measured or simulated; the output says
its times are a CPU's; ``--help`` names the rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hsdp_tools.bench.diloco import ROWS

SRC = Path(__file__).resolve().parents[2] / "src"
QUIET = ("no communication", "no outer communication")


def _hsdp(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "COLUMNS": "300"}
    return subprocess.run([sys.executable, "-m", "hsdp", "bench", "diloco", *argv], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_rows_without_communication_report_no_outer_bytes_and_a_cpu_caveat(tmp_path):
    run = _hsdp("--mesh", "2x2", "--outer-gbps", "3", "--rows", ",".join([*QUIET, "hsdp"]),
                "--steps", "1", "--warmup", "1", "--repeats", "1", "--layers", "1",
                "--json", "d.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "d.json").read_text())["outer_gbps"]["3"]
    for row in QUIET:
        assert rows[row]["outer_bytes_per_step"] == rows[row]["sim_outer_bytes_per_step"] == 0
    assert rows["hsdp"]["outer_bytes_per_step"] > 0 and rows["hsdp"][
        "sim_outer_bytes_per_step"] > 0, rows
    assert "measured on this machine's CPU" in run.stdout and "not a GPU's" in run.stdout


def test_help_names_every_row(tmp_path):
    run = _hsdp("--help", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())  # argparse wraps lines
    missing = [row for row in ROWS if row not in text]
    assert not missing, missing
