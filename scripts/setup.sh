#!/usr/bin/env bash
# Create .venv with the small CPU build of torch (pinned) and hsdp with its dev tools,
# then the hsdp[torchtitan] extra (tests/dist/test_torchtitan.py) with --no-deps: its packages'
# own requirements would pull a CUDA torch (pyproject.toml lists exactly what they import).
# --no-compile: byte-compiling every installed file takes a minute on two cores; an import
# writes the .pyc files it needs.
# On a GPU machine, install hsdp into the environment that already has CUDA torch instead:
#   pip install -e '.[bench]'
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 -e '.[dev]'
# Fault tolerance (hsdp[ft]): torchft 0.2.0 (a 2.5 MB wheel) without its torch requirement,
# then the small pure-Python packages it imports.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile --no-deps torchft==0.2.0
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile "opentelemetry-api>=1.39.0" \
    "opentelemetry-sdk>=1.39.0" "opentelemetry-exporter-otlp-proto-http>=1.39.0"
# hsdp[torchtitan], which includes hsdp[float8] (torchao), and hsdp[hf] (transformers):
# --no-deps keeps pip from touching torch.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile --no-deps $(.venv/bin/python -c \
  "import tomllib; e = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(' '.join(e['torchtitan'] + e['hf']))")
