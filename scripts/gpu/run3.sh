#!/bin/bash
# Call 3: longer real 1x2 (noise), emulated 16x8 and real 1x2 at seq 4096.
source scripts/gpu/prefix.sh
B="python3 -m hsdp bench step --reduce-dtype bf16"
run() { n=$1; shift; timeout $T $B "$@" --json $R/$n.json --out-dir /tmp/r/$n > /tmp/$n.log 2>&1; echo "$n rc $?"; tail -14 /tmp/$n.log | tee -a $R/steps.log; }
T=150 run real1x2_s1024_long --mesh 1x2 --seq 1024 --steps 15 --warmup 3 --schedules overlap,serial,fsdp2,mfsdp
T=110 run emu16x8_s4096 --emulate --mesh 16x8 --seq 4096 --steps 5 --warmup 2 --schedules overlap,serial,fsdp2,mfsdp
T=90 run real1x2_s4096 --mesh 1x2 --seq 4096 --steps 5 --warmup 2 --schedules overlap,serial,fsdp2,mfsdp
