#!/usr/bin/env bash
# Mixture of experts with expert parallelism on one H200 (torch 2.11, no internet): `bench
# step --arch moe` emulated 16x8 with ep 8 (8 Qwen3-30B-A3B-shaped blocks: 128 experts of
# width 768, 8 per token; hsdp_tools.models_moe), bf16 reduction, seq 4096: hsdp overlap,
# serial, hfsdp and overlap replayed as CUDA graphs, FSDP2, in one run; JSON and log into
# $OUT. SRC: where hsdp's sources are.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/moe_gpu}
mkdir -p "$OUT"
. scripts/gpu_env.sh
timeout "${STEP_TIMEOUT:-240}" python -m hsdp bench step --reduce-dtype bf16 \
    --record-steps 1 --trace-steps 1 --emulate --mesh 16x8 --arch moe --ep 8 \
    --seq 4096 --steps "${STEPS:-15}" --warmup 3 \
    --schedules "${SCHEDULES:-overlap,overlap-graph,serial,hfsdp,fsdp2}" \
    --json "$OUT/emu16x8_moe_ep8_s4096.json" --out-dir /tmp/moe_s4096 \
    > "$OUT/emu16x8_moe_ep8_s4096.log" 2>&1
echo "moe: exit $?"
grep -vE "^bench step: (built|warm|timed|memory|record|collective|traced)" \
    "$OUT/emu16x8_moe_ep8_s4096.log" | tail -30
