"""docs/guide/fault_tolerance.md as written: ``torchft_lighthouse`` and two torchruns of
``examples/ft_train.py`` (two replica groups of two gloo ranks) train to the last step in
one quorum. One change: the lighthouse waits for both groups (``--min_replicas 2``), else
the group that starts first may finish its few steps alone before the other has
imported torch. Kills, restarts and numerics: ``test_fault_tolerance.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import free_port

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


def test_two_replica_groups_train_in_one_quorum(tmp_path):
    port = free_port()
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "2",
         "--quorum_tick_ms", "100", "--join_timeout_ms", "10000", "--bind", f"[::]:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    groups = []
    try:
        for group in range(2):
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"),
                       REPLICA_GROUP_ID=str(group), TORCHFT_LIGHTHOUSE=f"http://localhost:{port}")
            log = open(tmp_path / f"group{group}.log", "w")
            groups.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(free_port()), str(ROOT / "examples" / "ft_train.py"),
                 "--outer", "2", "--steps", str(STEPS), "--step-s", "0"],
                env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [g.wait(timeout=300) for g in groups]
    finally:  # SIGTERM first: torchrun then stops its workers
        for p in (*groups, lighthouse):
            p.terminate()
        for p in (*groups, lighthouse):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    logs = [(tmp_path / f"group{g}.log").read_text() for g in range(2)]
    assert codes == [0, 0], [log[-3000:] for log in logs]
    for group, log in enumerate(logs):
        steps = re.findall(rf"replica group {group}: (\w+) step (\d+), (\d) group", log)
        # every step logged, the last one committed by both groups together
        assert steps and steps[-1] == ("committed", str(STEPS), "2"), log[-3000:]
