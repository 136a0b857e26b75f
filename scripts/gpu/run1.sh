#!/bin/bash
# Call 1: GPU tests (issue 11 acceptance, checkpoint on NCCL), concurrency table, checkpoint bench.
source scripts/gpu/prefix.sh
HSDP_TRACE_DIR=/tmp timeout 330 python3 -m pytest -q -rs tests/test_multi_gpu.py tests/test_cuda.py 2>&1 | tee $R/pytest.log | tail -40
mkdir -p /tmp/conc
for lo in 0 1; do for c in default inner=16,outer=8; do x=; [ $c = default ] || x="--max-ctas $c"
 NCCL_LAUNCH_ORDER_IMPLICIT=$lo timeout 60 python3 -m hsdp bench collectives --mesh 1x2 --shared-links $x \
   --iters 10 --warmup 3 --json /tmp/conc/lo${lo}_${c/,/_}.json; echo "rc $?"; done; done > $R/conc.log 2>&1
tar czf $R/conc.tgz -C /tmp conc; tail -60 $R/conc.log
timeout 90 python3 -m hsdp bench ckpt --nproc 2 --mesh 1x2 --json $R/ckpt_1x2.json > $R/ckpt.log 2>&1; echo "ckpt rc $?"; tail -25 $R/ckpt.log
