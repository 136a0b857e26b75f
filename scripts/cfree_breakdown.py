"""Device kernel time of one collective-free step (``bench step`` phase 6: emulated delays
off) of each schedule and of the unsharded reference, by kernel name, category and the
launching op (and hsdp annotation, for eager schedules), as JSON in $OUT.

Runs ``python -m hsdp bench step ARGS`` (same arguments, ``--emulate`` needed) up to phase
6, which is replaced by: the reference's warm-up, one step of each, 5 interleaved timed
collective-free steps, then one profiled step of each; it exits there. Example (GPU):
    OUT=out python scripts/cfree_breakdown.py bench step --reduce-dtype bf16 --record-steps 1 \
        --trace-steps 1 --warmup 3 --emulate --mesh 16x8 --seq 1024 --steps 2 \
        --schedules overlap,overlap-graph
GPU user annotations (``Optimizer.step#...``, ``hsdp:...``) are spans, not kernels: skipped.
"""
import json
import os
import re
import sys
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType

import hsdp_tools.bench.step as step

OUT = os.environ.get("OUT", "/tmp")
SEQ = sys.argv[sys.argv.index("--seq") + 1]
CATS = [
    ("sleep", r"spin_kernel"),
    ("gemm", r"gemm|cutlass|nvjet|sm90_|xmma|cublas|splitK"),
    ("attention", r"flash|fmha|attention|sdpa|pytorch_flash"),
    ("optimizer_foreach", r"multi_tensor_apply|[Aa]dam|foreach|_amp_foreach"),
    ("memcpy", r"^Memcpy"),
    ("memset", r"^Memset"),
    ("fill", r"FillFunctor"),
    ("copy_cast", r"copy_kernel|direct_copy|CopyFunctor|bfloat16_copy|float16_copy"),
    ("reduce", r"reduce_kernel|Reduce"),
    ("cat_index", r"CatArray|index|gather|scatter"),
    ("softmax_ce", r"softmax|nll|log_softmax|cross_entropy"),
    ("elementwise_other", r"elementwise|vectorized|unrolled"),
]


def cat_of(name):
    for c, pat in CATS:
        if re.search(pat, name):
            return c
    return "other"


def top_parent(e):
    """outermost hsdp annotation and the nearest aten op of a device event's CPU op"""
    ann, op = None, None
    p = e
    while p is not None:
        if p.name.startswith("hsdp"):
            ann = p.name
        elif op is None and p.name.startswith("aten::"):
            op = p.name
        p = p.cpu_parent
    return ann, op


def profile_one(t, batches, tracer_on):
    from torch.profiler import ProfilerActivity, profile
    (torch.cuda.synchronize() if torch.cuda.is_available() else None)
    if tracer_on:
        t.tracer.clear()
        t.tracer.enabled = True
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t.step(batches, delays=False)
        (torch.cuda.synchronize() if torch.cuda.is_available() else None)
    t.tracer.enabled = False
    if tracer_on:
        t.tracer.take()
    by_name = defaultdict(lambda: [0.0, 0])
    by_cat = defaultdict(float)
    by_parent = defaultdict(float)
    spans = []
    total = 0.0
    for e in prof.events():
        if e.name.startswith("hsdp") or "#" in e.name:  # GPU user annotations
            continue
        if cuda and e.device_type != DeviceType.CUDA:
            continue
        if not cuda and not e.name.startswith("aten::"):  # CPU: its aten ops
            continue
        d = e.time_range.elapsed_us()
        by_name[e.name][0] += d
        by_name[e.name][1] += 1
        c = cat_of(e.name)
        by_cat[c] += d
        total += d
        spans.append((e.time_range.start, e.time_range.end))
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.kernels:
            ann, op = top_parent(e)
            for k in e.kernels:
                by_parent[f"{cat_of(k.name)} | {ann} | {op}"] += k.duration
    spans.sort()
    union, cur_s, cur_e = 0.0, None, None
    for s, en in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                union += cur_e - cur_s
            cur_s, cur_e = s, en
        else:
            cur_e = max(cur_e, en)
    if cur_e is not None:
        union += cur_e - cur_s
    first = spans[0][0] if spans else 0
    last = max(e for _, e in spans) if spans else 0
    prof.export_chrome_trace(f"/tmp/cfree_{t.name}.json")
    return {
        "kernel_sum_ms": total / 1e3, "busy_union_ms": union / 1e3,
        "first_to_last_ms": (last - first) / 1e3,
        "by_category_ms": {k: round(v / 1e3, 3)
                           for k, v in sorted(by_cat.items(), key=lambda x: -x[1])},
        "by_kernel": [[n, round(v[0] / 1e3, 3), v[1]] for n, v in
                      sorted(by_name.items(), key=lambda x: -x[1][0])[:60]],
        "by_category_parent_ms": {k: round(v / 1e3, 3) for k, v in
                                  sorted(by_parent.items(), key=lambda x: -x[1])[:80]},
    }


orig = step._collective_free


def patched(cfg, trainees, batches, device, mesh):
    ref = step.build_unsharded(cfg.model, cfg.mp, cfg.inner, device, cfg.float8, None)
    for _ in range(cfg.warmup):
        ref.step(batches)
    for t in [*trainees, ref]:
        t.step(batches, delays=False)
    res = {"seq": SEQ, "torch": torch.__version__}
    # wall of collective-free steps, 5 each interleaved
    walls = defaultdict(list)
    for _ in range(5):
        for t in [*trainees, ref]:
            t0 = time.perf_counter()
            t.step(batches, delays=False)
            walls[t.name].append((time.perf_counter() - t0) * 1e3)
    res["free_ms"] = {k: sorted(v) for k, v in walls.items()}
    for t in [*trainees, ref]:
        res[t.name] = profile_one(t, batches, tracer_on=t.graphed is None and t is not ref)
    with open(f"{OUT}/cfree_breakdown_s{SEQ}.json", "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: (v["by_category_ms"], v["kernel_sum_ms"], v["busy_union_ms"])
                      for k, v in res.items() if isinstance(v, dict) and "by_category_ms" in v},
                     indent=1))
    print("free_ms", res["free_ms"])
    sys.exit(0)


step._collective_free = patched
from hsdp_tools.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
