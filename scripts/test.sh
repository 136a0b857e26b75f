#!/usr/bin/env bash
# The test command of the README and of CI: set up, lint, run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check src tests examples
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q --durations=15 "$@"
