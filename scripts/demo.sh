#!/usr/bin/env bash
# The main job of the README: set up, then a local multi-rank demo (CPU by default, GPUs
# when present).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
OMP_NUM_THREADS=1 .venv/bin/python -m hsdp demo "$@"
