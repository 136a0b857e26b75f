"""A training script that ends without ``destroy_process_group`` exits 0 on every rank
(gloo, 4 ranks, each its own process ending through the interpreter's normal exit:
``exit_jobs.py``), as with torch FSDP2. Under torchrun one rank ending on a signal marks
the job failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

JOBS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "exit_jobs.py")
RUNS, WORLD = 10, 4


@pytest.mark.full
@pytest.mark.parametrize("library", ["hsdp", "fsdp2"])
def test_ranks_exit_0_without_destroy_process_group(library):
    """hsdp's liveness responder sat in the store's C++ wait while the interpreter
    finalized: when rank 0's store closed, ranks aborted (SIGABRT) in most worlds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(JOBS),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, JOBS, library, str(RUNS), str(WORLD)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    worlds = json.loads(done.stdout.strip().splitlines()[-1])
    assert worlds == [[0] * WORLD] * RUNS, (worlds, done.stderr[-3000:])
