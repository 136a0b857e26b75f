"""``python -m hsdp bench suite``: its plan covers every table of docs/benchmarks.md, a
run of it writes what docs/results holds, and a trace's saved phases calibrate like it."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hsdp_tools.bench.suite import TABLES
from hsdp_tools.report.chrome_trace import load_chrome_trace
from hsdp_tools.sim.trace_phases import phases_from_trace, read_phases, save_phases

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"


def _suite(*argv: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsdp", "bench", "suite", *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _tables_of_the_benchmarks_page() -> list[str]:
    """Every ``## `` heading of docs/benchmarks.md with a table under it."""
    sections = re.split(r"^## ", (ROOT / "docs" / "benchmarks.md").read_text(), flags=re.M)
    return [s.split("\n", 1)[0].strip() for s in sections[1:] if "\n|---" in s]


def test_plan_names_every_table_of_the_benchmarks_page():
    proc = _suite("--dry-run", "--out", "results")
    assert proc.returncode == 0, proc.stderr
    planned = {line.split("]", 1)[0][1:] for line in proc.stdout.splitlines()}
    page = _tables_of_the_benchmarks_page()
    assert page and set(page) == planned == set(TABLES)
    # every run writes where docs/results keeps it
    for line in proc.stdout.splitlines():
        path = line.split("--json ", 1)[1].split()[0]
        assert path.startswith("results/") and path.endswith(".json")
        assert (ROOT / "docs" / path).exists(), path


@pytest.mark.full
def test_one_table_runs_on_cpu(tmp_path):
    table = "Collective overlap on CPU ranks"
    proc = _suite("--out", str(tmp_path), "--tables", table, "--extra-args",
                  "--sizes 64KiB --iters 1 --warmup 0", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"[{table}] collectives_gloo_2x2: ok" in proc.stdout
    out = tmp_path / "cpu" / "collectives_gloo_2x2.json"
    text = out.read_text()
    assert "\n" not in text  # compact, as in docs/results
    assert [r["size_bytes"] for r in json.loads(text)["rows"]] == [64 << 10]
    assert out.with_suffix(".log").exists()


def test_unknown_table_is_refused():
    proc = _suite("--dry-run", "--tables", "Section 18")
    assert proc.returncode != 0 and "unknown table" in proc.stderr


def test_saved_phases_equal_the_traces(tmp_path):
    """What ``save_phases`` keeps of a trace is what the calibration reads of it."""
    trace = DATA / "trace_h200_torch211_overlap.json.gz"
    step = tmp_path / "run" / "run.json"
    step.parent.mkdir()
    step.write_text(json.dumps({"schedules": {"overlap": {"traces": [str(trace)]},
                                              "fsdp2": None}}))
    [saved] = save_phases(step)
    assert saved == step.parent / "trace_h200_torch211_overlap.phases.json"
    direct = phases_from_trace(load_chrome_trace(trace))
    assert direct.side_host_ms and direct.collectives and read_phases(saved) == direct
    assert dataclasses.asdict(read_phases(saved)) == dataclasses.asdict(direct)
