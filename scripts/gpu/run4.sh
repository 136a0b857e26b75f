source scripts/gpu/prefix.sh
timeout 150 python3 -m hsdp bench ckpt --nproc 1 --layers 2 --repeats 2 --json $OUT/ckpt_1gpu.json > $OUT/ckpt.log 2>&1; echo "ckpt rc $?"; tail -20 $OUT/ckpt.log
