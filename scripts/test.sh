#!/usr/bin/env bash
# The test command of the README and of CI: set up, lint, run the default tier on CPU
# (every feature in its smallest world). `scripts/test.sh --full` adds the long end-to-end
# runs marked `@pytest.mark.full`. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not full")
if [ "${1:-}" = "--full" ]; then
    tier=()
    shift
fi
scripts/setup.sh
.venv/bin/ruff check src tests examples
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q --durations=15 "${tier[@]}" "$@"
