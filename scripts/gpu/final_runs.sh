#!/bin/bash
# The two-GPU runs of docs/benchmarks.md (issue-10 tables) and docs/sim_vs_measured.md, in
# two device calls of under 10 minutes each (nvidia-h200-x2; traces and host marks kept):
#   bash scripts/gpu/final_runs.sh tables   # collectives fits; 16x8 emulated, 1x2 and 2x1 real
#   bash scripts/gpu/final_runs.sh twins    # emulated twins of the real rows (fabric fitted
#                                           # from the first call's collectives, in .gpu/runs/),
#                                           # 2x4 at 12.5 GB/s, 16x8 with 4 microbatches, the
#                                           # two-GPU tests
#   bash scripts/gpu/final_runs.sh cuda     # tests/test_cuda.py
#   bash scripts/gpu/final_runs.sh sim      # the twins call without the tests (the rows of
#                                           # docs/sim_vs_measured.md only)
#   bash scripts/gpu/final_runs.sh emulated # after a change to emulation only: the emulated
#                                           # rows of both calls again (no real rows, no tests)
#   bash scripts/gpu/final_runs.sh emu16x8  # the emulated 16x8 rows of the tables alone
source scripts/gpu/prefix.sh
# 5 recorded and 3 profiled steps per schedule: the simulator's calibration takes the
# median host time and least device time over them (hsdp.sim.calibrate)
B="python3 -m hsdp bench step --reduce-dtype bf16 --record-steps 5 --trace-steps 3"
D=/tmp/runs; mkdir -p $D
run() { n=$1; T=$2; shift 2; mkdir -p $D/$n; timeout $T $B "$@" --json $D/$n/$n.json --out-dir $D/$n > $D/$n/log.txt 2>&1; echo "$n rc $?"; grep -A14 "bench step: mesh" $D/$n/log.txt | cut -c1-200 | grep "│\|vs"; rm -f $D/$n/timeline.png; }
emu16x8() {
  run emu16x8_s1024 100 --emulate --mesh 16x8 --seq 1024 --steps 5 --warmup 2 --schedules overlap,serial,fsdp2,mfsdp
  run emu16x8_s4096 100 --emulate --mesh 16x8 --seq 4096 --steps 5 --warmup 2 --schedules overlap,serial,fsdp2,mfsdp
  tar czf $R/emu16x8.tgz -C $D emu16x8_s1024 emu16x8_s4096
}
twins() {
  for m in 1x2 2x1; do for q in 1024 4096; do run emu${m}_s$q 60 --emulate --mesh $m --seq $q --steps 5 --warmup 2 --schedules overlap,serial --fabric-json .gpu/runs/coll$m.json; done; done
  tar czf $R/twins.tgz -C $D emu1x2_s1024 emu1x2_s4096 emu2x1_s1024 emu2x1_s4096
  run emu2x4_s4096_outer12.5 60 --emulate --mesh 2x4 --seq 4096 --outer-gbps 12.5 --steps 5 --warmup 2 --schedules overlap,serial,hfsdp,hfsdp-serial
  run emu16x8_s1024_mb4 80 --emulate --mesh 16x8 --seq 1024 --microbatches 4 --steps 4 --warmup 1 --schedules overlap,serial
  tar czf $R/extra.tgz -C $D emu2x4_s4096_outer12.5 emu16x8_s1024_mb4
}
if [ "$1" = tables ]; then
  for m in 1x2 2x1; do timeout 60 python3 -m hsdp bench collectives --mesh $m --sizes 4MiB,64MiB,256MiB --iters 5 --warmup 2 --json $D/coll$m.json > $D/coll$m.log 2>&1; echo "coll $m rc $?"; done
  emu16x8
  run real1x2_s1024 110 --mesh 1x2 --seq 1024 --steps 8 --warmup 2 --schedules overlap,serial,fsdp2,mfsdp
  run real1x2_s4096 80 --mesh 1x2 --seq 4096 --steps 5 --warmup 2 --schedules overlap,serial,fsdp2,mfsdp
  tar czf $R/real1x2.tgz -C $D real1x2_s1024 real1x2_s4096 coll1x2.json coll2x1.json
  # 2x1: each GPU holds a whole replica (32 GB resident a schedule): four schedules' models
  # side by side leave too little room, and the caching allocator's retries (a device
  # synchronization each) then time memory pressure, not schedules (benchmarks section
  # 15). Megatron-FSDP runs beside hsdp overlap in a process of its own.
  for q in 1024 4096; do
    run real2x1_s$q 110 --mesh 2x1 --seq $q --steps $((q == 1024 ? 8 : 5)) --warmup 2 --schedules overlap,serial,fsdp2
    run real2x1_s${q}_mfsdp 100 --mesh 2x1 --seq $q --steps $((q == 1024 ? 8 : 5)) --warmup 2 --schedules overlap,mfsdp
  done
  tar czf $R/real2x1.tgz -C $D real2x1_s1024 real2x1_s4096 real2x1_s1024_mfsdp real2x1_s4096_mfsdp
elif [ "$1" = twins ]; then
  twins
  timeout 150 python3 -m pytest -q tests/test_multi_gpu.py -k "parity or killed" > $R/pytest_two_gpus.log 2>&1; echo "pytest two GPUs rc $?"; tail -2 $R/pytest_two_gpus.log
  # the lagging-outer job without SideStream.hold: does it see the reuse? (expect False)
  timeout 60 python3 -c "from dist_utils import run_ranks; from parity_jobs import lagging_outer_job; print('without hold:', run_ranks(lagging_outer_job, 2, True, backend='nccl'))" 2>&1 | tail -1
elif [ "$1" = sim ]; then
  twins
elif [ "$1" = cuda ]; then
  timeout 200 python3 -m pytest -q tests/test_cuda.py > $R/pytest_cuda.log 2>&1; echo "pytest cuda rc $?"; tail -2 $R/pytest_cuda.log
elif [ "$1" = emulated ]; then
  emu16x8
  twins
elif [ "$1" = emu16x8 ]; then
  emu16x8
fi
ls -la $R
