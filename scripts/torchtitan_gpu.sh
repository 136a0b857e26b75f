#!/usr/bin/env bash
# torchtitan's own trainer (torchtitan.train, through scripts/torchtitan_gpu.py train: two
# stand-ins for torch 2.11) with hsdp and with torchtitan's FSDP2, each with torchtitan's
# default CUDA graphs of forward + backward and without ("hsdpeager", "fsdp2eager"; the
# BACKENDS run in turn, REPEATS times: A B C D A B C D ...) on the Llama3 debugmodel and 1B
# flavors: bf16 parameters (fp32 reduction), SDPA attention, the same initial weights (one
# seed checkpoint per flavor: hsdp's init_weights draws other random values than
# torchtitan's) and the same synthetic data, STEPS steps each. Writes per run the trainer
# log and a JSON of loss, tokens/s, TFLOPS, MFU and peak reserved memory per step under
# $OUT.
# For the GPU machine (no internet, CUDA torch installed): installs ./wheels (the extra's
# wheels that image lacks: torchtitan, torchao, spmd_types, torchdata, tyro,
# docstring_parser, typeguard, datasets, dill, multiprocess) --no-deps into $OUT/site.
# NGPU ranks on one host: 1 GPU gives a 1x1 mesh (no communication: it compares the two
# runtimes, not their sharding), 2 GPUs a 1x2 mesh (MESHES="1x2 2x1" for both: longer).
# Each run is capped at 110 s.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/torchtitan_gpu}
STEPS=${STEPS:-50}
NGPU=${NGPU:-$(python -c "import torch; print(torch.cuda.device_count())")}
MESHES=${MESHES:-$([ "$NGPU" -ge 2 ] && echo 1x$NGPU || echo 1x1)}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-index --target "$OUT/site" --find-links wheels \
  torchtitan==0.3.0 torchao==0.18.0 spmd_types==0.2.3 torchdata==0.11.0 tyro==1.0.17 \
  docstring_parser==0.18.0 typeguard==4.6.1 datasets==4.7.0 dill==0.4.1 multiprocess==0.70.19
export PYTHONPATH="$OUT/site:$PWD/src:$PWD/scripts" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 \
  HF_HOME="$OUT/hf" NCCL_NVLS_ENABLE=0
PY=python
$PY scripts/torchtitan_gpu.py assets "$OUT/assets"
for mesh in $MESHES; do
  for flavor in ${FLAVORS:-debugmodel 1b}; do
    # debugmodel: 16 x 2048 tokens per GPU; 1B: 4 x 2048
    bs=$([ "$flavor" = 1b ] && echo 4 || echo 16)
    common=(--hf_assets_path "$OUT/assets/tokenizer" --dataloader.dataset_path "$OUT/assets/data"
            --debug.seed 0 --checkpoint.enable --checkpoint.folder ckpt)
    seed="$OUT/seed_$flavor"
    [ -d "$seed/ckpt/step-0" ] || timeout 110 $PY -m torch.distributed.run --standalone \
      --nproc_per_node 1 scripts/torchtitan_gpu.py train --module torchtitan_gpu \
      --config "fsdp2_$flavor" "${common[@]}" --checkpoint.create_seed_checkpoint \
      --dump_folder "$seed" > "$seed.log" 2>&1
    # fsdp2, hsdp: torchtitan's default, forward + backward captured in a CUDA graph;
    # fsdp2eager, hsdpeager: without
    for rep in $(seq "${REPEATS:-1}"); do
    for backend in ${BACKENDS:-fsdp2 fsdp2eager hsdp hsdpeager}; do
      name="${backend}_${flavor}_${mesh}"; [ "${REPEATS:-1}" = 1 ] || name="${name}_r$rep"
      nproc=$(( ${mesh%x*} * ${mesh#*x} ))
      eager=(); [ "${backend%eager}" != "$backend" ] && eager=(--training.disable_cuda_graphs)
      timeout 110 $PY -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
        scripts/torchtitan_gpu.py train --module torchtitan_gpu \
        --config "${backend%eager}_${flavor}" "${eager[@]}" \
        "${common[@]}" --checkpoint.initial_load_path "$seed/ckpt/step-0" \
        --checkpoint.load_only --dump_folder "$OUT/$name" \
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
done
