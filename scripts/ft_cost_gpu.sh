#!/usr/bin/env bash
# The cost of fault tolerance on one GPU: step time with it on vs off (scripts/ft_cost.py, one
# replica group of one rank), every run of docs/benchmarks.md's table "Fault tolerance
# (torchft) on one H200" (`bench suite`: seq 1024 and 4096, 8 and 32 layers, AdamW foreach
# and fused, each setting twice, off and on alternated), JSON and logs under $OUT/h200/ft_cost
# (default out/ft_cost), then the table. Run on the GPU machine in the environment that has
# CUDA torch (2.11+): torchft and what it imports are installed offline from wheels/
# (gitignored: the versions of pyproject's "ft" extra, torchft for cp310-cp312), --no-index
# so that torch is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/ft_cost}
python -c "import torchft" 2>/dev/null ||
    # --no-deps: torchft's torch requirement must not touch the CUDA torch already there;
    # what it imports comes from wheels/ too
    python -m pip install -q --no-index --no-deps --find-links wheels torchft==0.2.0 \
        $(ls wheels | grep -E '^(opentelemetry|googleapis)' | cut -d- -f1 | tr _ -)
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
python -m hsdp bench suite --out "$OUT" --tables "Fault tolerance (torchft) on one H200" || true
python - "$OUT/h200/ft_cost" <<'PY'
import json, pathlib, statistics, sys
runs = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("seq*.json"))]
for key in sorted({(r["seq"], r["layers"], r.get("optimizer", "foreach")) for r in runs}):
    ms = {ft: statistics.median(r["median_ms"] for r in runs if r["ft"] == ft and
                                (r["seq"], r["layers"], r.get("optimizer", "foreach")) == key)
          for ft in ("off", "on")}
    print(f"seq {key[0]}, {key[1]} layers, AdamW {key[2]}: off {ms['off']:.1f} ms, "
          f"on {ms['on']:.1f} ms, {100 * (ms['on'] / ms['off'] - 1):+.1f} %")
PY
