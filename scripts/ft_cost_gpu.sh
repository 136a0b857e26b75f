#!/usr/bin/env bash
# The cost of fault tolerance on one GPU (issue 28): step time with it on vs off at seq 1024
# and 4096 (scripts/ft_cost.py, one replica group of one rank), JSON under $OUT (default
# out/ft_cost). Run on the GPU machine in the environment that has CUDA torch (2.11+):
# torchft and what it imports are installed offline from wheels/ (gitignored, 9 MB: the
# versions of pyproject's "ft" extra, torchft for cp310-cp312), --no-index so that torch is
# never replaced. Each setting runs twice, off and on alternated.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/ft_cost}
mkdir -p "$OUT"
python -c "import torchft" 2>/dev/null ||
    # --no-deps: torchft's torch requirement must not touch the CUDA torch already there;
    # what it imports comes from wheels/ too
    python -m pip install -q --no-index --no-deps --find-links wheels torchft==0.2.0 \
        $(ls wheels | grep -E '^(opentelemetry|googleapis)' | cut -d- -f1 | tr _ -)
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
for seq in 1024 4096; do
    for run in 1 2; do
        for ft in off on; do
            MASTER_PORT=$((29700 + RANDOM % 200)) python scripts/ft_cost.py --ft "$ft" \
                --seq "$seq" --out "$OUT/seq${seq}_${ft}_${run}.json"
        done
    done
done
python - "$OUT" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = [json.loads(p.read_text()) for p in sorted(out.glob("seq*_*.json"))]
table = []
for seq in sorted({r["seq"] for r in rows}):
    ms = {ft: statistics.median(r["median_ms"] for r in rows if r["seq"] == seq and r["ft"] == ft)
          for ft in ("off", "on")}
    table.append({"seq": seq, "off_ms": ms["off"], "on_ms": ms["on"],
                  "overhead_pct": 100 * (ms["on"] / ms["off"] - 1)})
(out / "ft_cost.json").write_text(json.dumps({"runs": rows, "table": table}, indent=1))
for t in table:
    print(f"seq {t['seq']}: off {t['off_ms']:.1f} ms, on {t['on_ms']:.1f} ms, "
          f"{t['overhead_pct']:+.1f}%")
PY
