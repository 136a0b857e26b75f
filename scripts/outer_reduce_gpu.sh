#!/usr/bin/env bash
# The compressed outer reduction on one H200 (torch 2.11, no internet): its kernels' time
# (`python -m hsdp bench quant`), then `bench step` emulated 16x8, 8 Llama-8B-like
# layers, seq 4096 and 1024 (SEQS), bf16 reduction, at outer 47, 25, 12.5 and 3 GB/s (GBPS):
# hsdp and hfsdp exact and int8 (overlap-q, hfsdp-q), hfsdp with the gather compressed too
# (hfsdp-qg), FSDP2 (and Megatron-FSDP where it is installed), alternated, in one run per
# row; the quantization kernels' ms per step and streams from each run's traces
# (scripts/quant_kernel_ms.py); JSON, logs and the kernels' table into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/outer_reduce_gpu}
mkdir -p "$OUT"
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hsdp bench quant --json "$OUT/quant.json" 2>&1 | tee "$OUT/kernels.md"
SCHEDULES=${SCHEDULES:-overlap,overlap-q,hfsdp,hfsdp-q,hfsdp-qg,fsdp2}
python -c "import megatron_fsdp" 2>/dev/null && SCHEDULES=$SCHEDULES,mfsdp
for seq in ${SEQS:-4096 1024}; do
for gbps in ${GBPS:-47 25 12.5 3}; do
    name=s${seq}_outer$gbps
    timeout "${STEP_TIMEOUT:-200}" python -m hsdp bench step --reduce-dtype bf16 \
        --record-steps 2 --trace-steps 1 --warmup 2 --emulate --mesh 16x8 --seq "$seq" \
        --steps "${STEPS:-4}" --outer-reduce int8 --outer-gather int8 --schedules "$SCHEDULES" \
        --outer-gbps "$gbps" --json "$OUT/step_$name.json" --out-dir "/tmp/step_$name" \
        > "$OUT/step_$name.log" 2>&1
    echo "seq $seq outer $gbps GB/s: exit $?"
    python scripts/quant_kernel_ms.py "/tmp/step_$name" 1 --json "$OUT/kernels_$name.json"
    grep -E "overlap|hfsdp|fsdp2|mfsdp|free /" "$OUT/step_$name.log" | grep -v "^bench step" | tail -9
done
done
