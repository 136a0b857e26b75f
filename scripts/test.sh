#!/usr/bin/env bash
# The test command of the README and of CI: set up, lint, run the default tier on CPU
# (every feature in its smallest world). `scripts/test.sh --full` adds the long end-to-end
# runs marked `@pytest.mark.full`. With other arguments, one pytest run takes them.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not full")
if [ "${1:-}" = "--full" ]; then
    tier=()
    shift
fi
scripts/setup.sh
.venv/bin/ruff check src tests examples
# setup.sh installs without byte-compiling every file: each import writes the .pyc it needs.
unset PYTHONDONTWRITEBYTECODE
export OMP_NUM_THREADS=1
pytest=(.venv/bin/python -m pytest -q --durations=15 "${tier[@]}")
if [ $# -gt 0 ]; then
    exec "${pytest[@]}" "$@"
fi
# The one-process unit tests on up to 4 cores (pytest-xdist), then the multi-rank worlds
# and the GPU tests one at a time (a world's ranks already take every core, a GPU test the
# GPU). Both runs happen even if the first fails.
rc=0
"${pytest[@]}" -n "$(( $(nproc) < 4 ? $(nproc) : 4 ))" tests/unit || rc=$?
"${pytest[@]}" tests/dist tests/gpu || rc=$?
exit "$rc"
