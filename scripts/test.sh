#!/usr/bin/env bash
# The test command of the README and of CI: set up, lint, run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check src tests examples
# Two pytest workers, one file each at a time (its spawned world and module fixtures stay
# together): the multi-rank tests spend much of their time in timeouts and process start-up.
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q --durations=15 -n "${HSDP_TEST_WORKERS:-2}" \
    --dist loadfile "$@"
