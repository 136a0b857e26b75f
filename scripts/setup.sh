#!/usr/bin/env bash
# Create .venv with the small CPU build of torch (pinned) and hsdp with its dev tools,
# then the hsdp[torchtitan] extra (tests/test_torchtitan.py) with --no-deps: its packages'
# own requirements would pull a CUDA torch (pyproject.toml lists exactly what they import).
# On a GPU machine, install hsdp into the environment that already has CUDA torch instead:
#   pip install -e '.[bench]'
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[dev]'
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps $(.venv/bin/python -c \
  "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['torchtitan']))")
