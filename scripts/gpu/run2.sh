#!/bin/bash
# Call 2: step tables (issue 10/11): real 1x2 and 2x1 with emulated twins, emulated 16x8.
source scripts/gpu/prefix.sh
B="python3 -m hsdp bench step --reduce-dtype bf16 --steps 5 --warmup 2"
run() { n=$1; shift; timeout $T $B "$@" --json $R/$n.json --out-dir /tmp/r/$n > /tmp/$n.log 2>&1; echo "$n rc $?"; tail -22 /tmp/$n.log | tee -a $R/steps.log; }
timeout 60 python3 -m hsdp bench collectives --mesh 1x2 --sizes 4MiB,64MiB,256MiB --iters 5 --warmup 2 --json $R/coll1x2.json > /tmp/c.log 2>&1; echo "coll rc $?"
T=150 run real1x2_s1024 --mesh 1x2 --seq 1024 --schedules overlap,serial,fsdp2,mfsdp
T=80 run emu1x2_s1024 --emulate --mesh 1x2 --seq 1024 --schedules overlap,serial --fabric-json $R/coll1x2.json
T=120 run emu16x8_s1024 --emulate --mesh 16x8 --seq 1024 --schedules overlap,serial,fsdp2,mfsdp
T=110 run real2x1_s1024 --mesh 2x1 --seq 1024 --schedules overlap,serial,fsdp2
