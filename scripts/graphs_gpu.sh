#!/usr/bin/env bash
# hsdp's step replayed as CUDA graphs on one H200 (torch 2.11, no internet): `bench step`
# emulated 16x8, 8 Llama-8B-like layers, bf16 reduction, at seq 1024 and 4096: hsdp
# overlap and serial eager and replayed (-graph), FSDP2 eager, in one run each (the
# collective-free step of each against the unsharded reference comes with it); JSON and
# logs into $OUT, the overlap schedules' Chrome traces too.
# SRC: where hsdp's sources are (default src).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/graphs_gpu}
mkdir -p "$OUT"
. scripts/gpu_env.sh
for seq in ${SEQS:-1024 4096}; do
    timeout "${STEP_TIMEOUT:-240}" python -m hsdp bench step --reduce-dtype bf16 \
        --record-steps 1 --trace-steps 1 --warmup 3 --emulate --mesh 16x8 --seq "$seq" \
        --steps "${STEPS:-8}" --schedules overlap,overlap-graph,serial,serial-graph,fsdp2 \
        --json "$OUT/emu16x8_s${seq}_graphs.json" --out-dir "/tmp/graphs_s$seq" \
        > "$OUT/emu16x8_s${seq}_graphs.log" 2>&1
    echo "seq $seq: exit $?"
    grep -vE "^bench step: (built|warm|timed|memory|record|collective|traced)" \
        "$OUT/emu16x8_s${seq}_graphs.log" | tail -30
done
for seq in ${SEQS:-1024 4096}; do
    for name in overlap overlap-graph; do
        cp "/tmp/graphs_s$seq/trace_$name.json.gz" "$OUT/trace_${name}_s$seq.json.gz" 2>/dev/null
    done
done
exit 0
