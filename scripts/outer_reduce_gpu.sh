#!/usr/bin/env bash
# The compressed outer reduction on one H200 (torch 2.11, no internet): its kernels' time
# (`python -m hsdp bench quant`), then `bench step` emulated 16x8, 8 Llama-8B-like
# layers, seq 4096, bf16 reduction, at outer 12.5, 3 and 47 GB/s: hsdp and hfsdp exact and
# int8 (overlap-q, hfsdp-q), FSDP2 (and Megatron-FSDP where it is installed) in one run
# each; JSON, logs and the kernels' table into $OUT. About 3 minutes on a warm machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/outer_reduce_gpu}
mkdir -p "$OUT"
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hsdp bench quant --json "$OUT/quant.json" 2>&1 | tee "$OUT/kernels.md"
SCHEDULES=overlap,overlap-q,hfsdp,hfsdp-q,fsdp2
python -c "import megatron_fsdp" 2>/dev/null && SCHEDULES=$SCHEDULES,mfsdp
for gbps in ${GBPS:-12.5 3 47}; do
    timeout "${STEP_TIMEOUT:-200}" python -m hsdp bench step --reduce-dtype bf16 \
        --record-steps 2 --trace-steps 1 --warmup 2 --emulate --mesh 16x8 --seq 4096 \
        --steps 4 --outer-reduce int8 --schedules "$SCHEDULES" --outer-gbps "$gbps" \
        --json "$OUT/step_outer$gbps.json" --out-dir "/tmp/step_outer$gbps" \
        > "$OUT/step_outer$gbps.log" 2>&1
    echo "outer $gbps GB/s: exit $?"
    grep -E "overlap|hfsdp|fsdp2|mfsdp|free /" "$OUT/step_outer$gbps.log" | grep -v "^bench step" | tail -8
done
