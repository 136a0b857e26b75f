#!/usr/bin/env bash
# advise against measurement on one H100 / H200 (emulated 16x8: one process poses as rank 0,
# every collective delayed by its modelled time). For each outer link (47, 12.5, 3 GB/s):
# `python -m hsdp advise` prices exact / int8 / DiLoCo H10 / DiLoCo H50 with the card's
# committed profile (links given: nothing measured, no ranks started), then `python -m
# hsdp bench diloco --device cuda` measures the same modes on the GPU in one run (rows hsdp,
# hsdp int8, DiLoCo H10 F4, DiLoCo H50 F4; advise uses 4 fragments for this model), and
# a comparison writes $OUT/advise_vs_measured.json: per link, advise's choice, the fastest
# measured mode, and each mode's predicted / measured step time. Model: Llama-8B's width,
# 5 layers (8 units: 4 fragments divide them), seq 4096, bf16, mbs 1; inner 370 GB/s,
# latency 20 us. About 4 minutes on a warm machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/advise_gpu}
mkdir -p "$OUT"
. scripts/gpu_env.sh
GBPS=${GBPS:-47 12.5 3}
MODEL=(--model llama-8b --layers 5 --seq 4096)
for gbps in $GBPS; do
    timeout 120 python -m hsdp advise "${MODEL[@]}" --mesh 16x8 --outer-gbps "$gbps" \
        --inner-gbps 370 --latency-us 20 --json "$OUT/advise_$gbps.json" \
        > "$OUT/advise_$gbps.log" 2>&1
    echo "advise at outer $gbps GB/s: exit $?"; tail -9 "$OUT/advise_$gbps.log"
done
timeout "${MEASURE_TIMEOUT:-330}" python -m hsdp bench diloco --device cuda --mesh 16x8 \
    "${MODEL[@]}" --dtype bf16 --mbs 1 --inner-gbps 370 --latency-us 20 \
    --outer-gbps "$(echo $GBPS | tr ' ' ',')" --warmup 2 --repeats 2 --steps 5 \
    --rows "no communication,hsdp,hsdp int8,DiLoCo H10 F4,DiLoCo H50 F4" \
    --json "$OUT/measured.json" > "$OUT/measured.log" 2>&1
echo "bench diloco: exit $?"; tail -25 "$OUT/measured.log"
python - "$OUT" $GBPS <<'PY'
import json, sys
from pathlib import Path

out, gbps = Path(sys.argv[1]), sys.argv[2:]
ROW = {"exact": "hsdp", "int8": "hsdp int8", "diloco H10": "DiLoCo H10 F4",
       "diloco H50": "DiLoCo H50 F4"}
measured = json.loads((out / "measured.json").read_text())["outer_gbps"]
result = {}
for g in gbps:
    advice = json.loads((out / f"advise_{g}.json").read_text())
    got = measured[f"{float(g):g}"]
    modes = {r["mode"]: {"predicted_ms": r["t_step_ms"],
                         "measured_ms": got[ROW[r["mode"]]]["t_step_ms"]}
             for r in advice["modes"]}
    for m in modes.values():
        m["error_pct"] = 100 * (m["predicted_ms"] / m["measured_ms"] - 1)
    fastest = min(modes, key=lambda k: modes[k]["measured_ms"])
    choice = advice["choice"]
    result[g] = {"choice": choice, "fastest_measured": fastest,
                 "choice_is_fastest": choice == fastest,
                 "choice_within_2pct_of_fastest":
                     modes[choice]["measured_ms"] <= 1.02 * modes[fastest]["measured_ms"],
                 "choice_prediction_within_5pct": abs(modes[choice]["error_pct"]) <= 5,
                 "modes": modes}
    print(f"outer {g} GB/s: advise {choice}, fastest measured {fastest}; " + ", ".join(
        f"{k} {m['predicted_ms']:.1f}/{m['measured_ms']:.1f} ms ({m['error_pct']:+.1f}%)"
        for k, m in modes.items()))
(out / "advise_vs_measured.json").write_text(json.dumps(result, indent=2))
PY
