#!/usr/bin/env bash
# torchtitan's own trainer (torchtitan.train) with hsdp and with torchtitan's FSDP2 on the
# Llama3 debugmodel and 1B flavors: bf16 parameters (fp32 reduction), flex attention, the
# same seed and the same synthetic data, STEPS steps each. Writes per run the trainer log
# and a JSON of loss, tokens/s, TFLOPS, MFU and peak reserved memory per step under $OUT.
# For the GPU machine (no internet, CUDA torch installed): installs ./wheels (made on the
# CPU machine, see README: Using hsdp in torchtitan) --no-deps into a venv that sees the
# machine's torch. NGPU ranks on one host: 1 GPU gives a 1x1 mesh (no communication:
# it compares the runtimes, not the sharding), 2 GPUs run 1x2 and 2x1.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/torchtitan_gpu}
STEPS=${STEPS:-50}
NGPU=${NGPU:-$(python -c "import torch; print(torch.cuda.device_count())")}
mkdir -p "$OUT"
python -m venv --system-site-packages "$OUT/venv"
"$OUT/venv/bin/python" -m pip install -q --no-deps --no-index wheels/*.whl
export PYTHONPATH="$PWD/src:$PWD/scripts" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 \
  HF_HOME="$OUT/hf" NCCL_NVLS_ENABLE=0
PY="$OUT/venv/bin/python"
$PY scripts/torchtitan_gpu.py assets "$OUT/assets"
meshes="1x1"
[ "$NGPU" -ge 2 ] && meshes="1x2 2x1"
for mesh in $meshes; do
  for flavor in debugmodel 1b; do
    # debugmodel: 16 x 2048 tokens per GPU; 1B: 4 x 2048
    bs=$([ "$flavor" = 1b ] && echo 4 || echo 16)
    for backend in fsdp2 hsdp; do
      name="${backend}_${flavor}_${mesh}"
      timeout 300 $PY -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        -m torchtitan.train --module torchtitan_gpu --config "${backend}_${flavor}" \
        --hf_assets_path "$OUT/assets/tokenizer" \
        --dataloader.dataset_path "$OUT/assets/data" \
        --dump_folder "$OUT/$name" --debug.seed 0 --debug.deterministic \
        --training.steps "$STEPS" --training.local_batch_size "$bs" --training.seq_len 2048 \
        --parallelism.data_parallel_replicate_degree "${mesh%x*}" \
        --parallelism.data_parallel_shard_degree "${mesh#*x}" \
        --metrics.log_freq 1 --metrics.disable_color_printing \
        > "$OUT/$name.log" 2>&1 || echo "$name failed (see $name.log)"
      $PY scripts/torchtitan_gpu.py summarize "$OUT/$name.log" > "$OUT/$name.json"
      echo "$name: $(tail -c 300 "$OUT/$name.json")"
    done
  done
done
