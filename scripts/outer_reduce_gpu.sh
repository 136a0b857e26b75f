#!/usr/bin/env bash
# The compressed outer reduction on one GPU (no internet): `bench step` emulated 16x8,
# 8 Llama-8B-like layers (vocabulary 32768, bench step's GPU default), seq 4096 and 1024
# (SEQS), bf16 reduction, at outer 47, 25, 12.5 and 3 GB/s (GBPS): hsdp and hfsdp exact and int8
# (overlap-q, hfsdp-q), hfsdp with the gather compressed too (hfsdp-qg), FSDP2 (and
# Megatron-FSDP where it is installed), alternated, in one run per row; each schedule also
# RUN_STEPS steps back to back (t_run: hfsdp's outer all-gather overlaps the next forward);
# the quantization kernels' ms per step and streams from each run's traces
# (scripts/quant_kernel_ms.py); then the kernels' own time (`python -m hsdp bench quant`;
# QUANT=0: not). Everything lands in $OUT as one tarball (results.tar.gz:
# JSON, logs, kernel tables) plus summary.txt.
#
# PREDICT=PROFILE (CPU, before the run): the simulator's predictions of the same rows from
# a machine profile, into $OUT/prediction_s<SEQ>.json; the model and mesh flags are the ones
# the bench runs with (MODEL below), so the prediction prices the model that is measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/outer_reduce_gpu}
mkdir -p "$OUT"
. scripts/gpu_env.sh
MODEL="--mesh 16x8 --layers 8 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 32768
       --mbs 1 --reduce-dtype bf16"
SEQS=${SEQS:-4096 1024}
GBPS=${GBPS:-47 25 12.5 3}
if [ -n "${PREDICT:-}" ]; then
    for seq in $SEQS; do
        # shellcheck disable=SC2086
        python -m hsdp sim --profile "$PREDICT" $MODEL --seq "$seq" --sweep \
            "outer_gbps=$(echo $GBPS | tr ' ' ,)" strategy=hsdp,hfsdp outer_reduce=none,int8 \
            outer_gather=none,int8 --json "$OUT/prediction_s$seq.json" | tail -n 25
    done
    exit 0
fi
RES=$(mktemp -d)
pack() {  # after every part: a timeout keeps the parts done
    tar -czf "$OUT/.results.tar.gz" -C "$RES" . && mv "$OUT/.results.tar.gz" "$OUT/results.tar.gz"
}
SCHEDULES=${SCHEDULES:-overlap,overlap-q,hfsdp,hfsdp-q,hfsdp-qg,fsdp2}
python -c "import megatron_fsdp" 2>/dev/null && SCHEDULES=$SCHEDULES,mfsdp
for seq in $SEQS; do
for gbps in $GBPS; do
    name=s${seq}_outer$gbps
    # shellcheck disable=SC2086
    timeout "${STEP_TIMEOUT:-200}" python -m hsdp bench step $MODEL --record-steps 2 \
        --trace-steps 1 --warmup 2 --emulate --seq "$seq" --steps "${STEPS:-4}" \
        --run-steps "${RUN_STEPS:-4}" --outer-reduce int8 --outer-gather int8 \
        --schedules "$SCHEDULES" --outer-gbps "$gbps" --json "$RES/step_$name.json" \
        --out-dir "/tmp/step_$name" > "$RES/step_$name.log" 2>&1
    echo "seq $seq outer $gbps GB/s: exit $?" | tee -a "$OUT/summary.txt"
    python scripts/quant_kernel_ms.py "/tmp/step_$name" 1 --json "$RES/kernels_$name.json"
    grep -E "overlap|hfsdp|fsdp2|mfsdp|free /" "$RES/step_$name.log" | grep -v "^bench step" \
        | tail -9 | tee -a "$OUT/summary.txt"
    pack
done
done
if [ "${QUANT:-1}" = 1 ]; then  # QUANT=0: the step rows only
    python -m hsdp bench quant --json "$RES/quant.json" 2>&1 | tee "$RES/kernels.md" \
        | tail -n 12 >> "$OUT/summary.txt"
    pack
fi
