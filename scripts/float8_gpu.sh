#!/usr/bin/env bash
# Float8 on one H200 (torch 2.11, no internet), emulated 16x8 mesh, 8 Llama-8B-like layers
# (hidden 4096, ffn 14336, 32 heads, 8 KV heads, vocab 32768, bf16), at seq 4096 and 8192:
#   hsdp float8 (overlap) and FSDP2 + torchao float8 (float8 all-gather on) side by side in
#   one `bench step --float8` run, then hsdp bf16 (overlap) in a second one;
# step time (median [min-max]), peak memory and this rank's inner all-gather bytes per step
# (the bench's collective record), into $OUT/float8_gpu.json (plus each run's JSON).
# torchao comes from wheels/ (gitignored; pip download --no-deps torchao==0.18.0 -d wheels).
# About 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/float8_gpu}
mkdir -p "$OUT"
python -c "import torchao" 2>/dev/null ||
    python -m pip install -q --no-deps --no-index --find-links wheels torchao==0.18.0
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
COMMON=(--emulate --mesh 16x8 --layers 8 --steps 10 --warmup 3 --record-steps 1
        --trace-steps 1)
for seq in 4096 8192; do
    python -m hsdp bench step "${COMMON[@]}" --seq "$seq" --float8 --schedules overlap,fsdp2 \
        --json "$OUT/float8_seq$seq.json" --out-dir "$OUT/float8_seq$seq"
    python -m hsdp bench step "${COMMON[@]}" --seq "$seq" --schedules overlap \
        --json "$OUT/bf16_seq$seq.json" --out-dir "$OUT/bf16_seq$seq"
done
python - "$OUT" <<'EOF'
import json
import sys

out = sys.argv[1]
rows = {}
for seq in (4096, 8192):
    runs = {kind: json.load(open(f"{out}/{kind}_seq{seq}.json")) for kind in ("float8", "bf16")}
    named = {"hsdp float8": runs["float8"]["schedules"]["overlap"],
             "fsdp2 float8": runs["float8"]["schedules"]["fsdp2"],
             "hsdp bf16": runs["bf16"]["schedules"]["overlap"]}
    row = {name: {"t_step_ms": s["t_step_ms"], "t_step_min_ms": s["t_step_min_ms"],
                  "t_step_max_ms": s["t_step_max_ms"], "peak_mem_gib": s["peak_mem_bytes"] / 2**30,
                  "inner_all_gather_bytes": s["collective_bytes_per_step"].get("all_gather:inner")}
           for name, s in named.items()}
    h, f, b = row["hsdp float8"], row["fsdp2 float8"], row["hsdp bf16"]
    row["hsdp_float8_over_fsdp2_float8_step"] = h["t_step_ms"] / f["t_step_ms"]
    row["hsdp_float8_over_hsdp_bf16_step"] = h["t_step_ms"] / b["t_step_ms"]
    row["hsdp_float8_over_fsdp2_float8_peak_mem"] = h["peak_mem_gib"] / f["peak_mem_gib"]
    row["float8_over_bf16_inner_all_gather_bytes"] = (h["inner_all_gather_bytes"]
                                                      / b["inner_all_gather_bytes"])
    rows[f"seq {seq}"] = row
meta = runs["float8"]["meta"]
result = {"mesh": "16x8 emulated", "model": meta["model"], "torch": meta["torch"],
          "hardware": meta["hardware"], "rows": rows}
json.dump(result, open(f"{out}/float8_gpu.json", "w"), indent=1)
for seq, row in rows.items():
    print(seq)
    for name in ("hsdp float8", "fsdp2 float8", "hsdp bf16"):
        r = row[name]
        print(f"  {name:13s} {r['t_step_ms']:7.1f} ms [{r['t_step_min_ms']:.1f}-"
              f"{r['t_step_max_ms']:.1f}]  peak {r['peak_mem_gib']:6.2f} GiB  inner AG "
              f"{r['inner_all_gather_bytes'] / 2**20:8.1f} MiB/step")
    print("  " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if not isinstance(v, dict)))
EOF
