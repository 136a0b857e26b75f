"""What is allocated at each schedule's peak of one training step (issue 10, memory).

    python scripts/memory_at_peak.py --emulate --mesh 16x8 --seq 4096 --schedules overlap,fsdp2

Builds each schedule as ``bench step`` does (same model, mesh, precision, optimizer; on
one GPU, emulated meshes on torch's fake process group), runs warm-up steps, then records
the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``) over
one step of each schedule in turn. Replaying the history gives the allocated bytes over
the step (an allocation counts until its ``free_completed``); at the peak, the blocks
alive that the step allocated are grouped by the innermost frame in hsdp, torch's FSDP or
Megatron-FSDP, or the model (else the innermost Python frame), and printed, largest
first, with what the step freed of the memory held before it. ``--resident``: instead,
what each schedule holds between steps (after its warm-up), grouped the same way, from the
history recorded since before the model was built; run one schedule per process then
(another schedule's leftovers would count). CUDA only.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from hsdp_tools.bench.emulate import fake_mesh
from hsdp_tools.bench.step_config import add_arguments, resolve
from hsdp_tools.bench.trainee import build, synthetic_batches

OWN = ("/hsdp/", "/fsdp/", "megatron_fsdp", "/_fully_shard/")


def _where(frames: list[dict]) -> str:
    for f in frames:
        if any(o in f["filename"] for o in OWN) and "memory_at_peak" not in f["filename"]:
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    for f in frames:
        if f["filename"].endswith(".py") and "/torch/" not in f["filename"]:
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return "?"


def peak_of(events: list[dict]) -> tuple[int, dict[int, tuple[int, str]], int]:
    """(peak rise over the step's start, blocks alive at the peak that the step allocated
    {addr: (size, where)}, bytes held before the step and freed by the peak)."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = freed_old = 0
    at_peak: dict[int, tuple[int, str]] = {}
    freed_at_peak = 0
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            now += e["size"]
        elif e["action"] == "free_completed":
            now -= e["size"]
            if live.pop(e["addr"], None) is None:
                freed_old += e["size"]
        if now > peak:
            peak, at_peak, freed_at_peak = now, dict(live), freed_old
    return peak, at_peak, freed_at_peak


def resident(name: str, snap: dict, device: int, top: int) -> None:
    """Print the blocks allocated on ``device`` at the snapshot, grouped by ``_where``,
    with their sizes."""
    by: dict[str, list[int]] = defaultdict(list)
    asked: dict[str, int] = defaultdict(int)
    for seg in snap["segments"]:
        if seg["device"] != device:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":  # size: as the allocator counts it
                where = _where(b.get("frames", []))
                by[where].append(b["size"])
                asked[where] += b.get("requested_size", b["size"])
    print(f"== {name}: held between steps {sum(map(sum, by.values()))} B "
          f"({sum(asked.values())} B requested)")
    for where, sizes in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"   {sum(sizes):>14} B  {len(sizes):>5} blocks  {where} "
              f"({asked[where]} B requested)")
        print(f"      sizes: {sorted(sizes)}")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--resident", action="store_true", help="what is held between steps")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("memory_at_peak: needs a GPU")
    cfg = resolve(args, True, None)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    mesh = fake_mesh(cfg.outer, cfg.inner, "cuda") if cfg.emulate else None
    if mesh is None:
        sys.exit("memory_at_peak: emulated meshes only (--emulate)")
    batches = synthetic_batches(cfg.model.vocab, cfg.mbs, cfg.model.seq, cfg.microbatches, dev)
    groups: dict[str, dict[str, int]] = {}
    for name in cfg.schedules:
        if args.resident:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        t = build(name, cfg.model, cfg.mp, mesh, dev, cfg.fabric, True)
        for _ in range(max(cfg.warmup, 2)):
            t.step(batches)
        torch.cuda.synchronize()
        if args.resident:
            resident(name, torch.cuda.memory._snapshot(), dev.index, args.top)
            torch.cuda.memory._record_memory_history(enabled=None)
            continue
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        t.step(batches)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        events = snap["device_traces"][dev.index]
        peak, alive, freed = peak_of(events)
        by: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for size, where in alive.values():
            by[where][0] += size
            by[where][1] += 1
        groups[name] = {k: v[0] for k, v in by.items()}
        print(f"== {name}: held before the step {base} B; max_memory_allocated over it "
              f"{torch.cuda.max_memory_allocated(dev)} B; replayed peak rise {peak} B = "
              f"{sum(s for s, _ in alive.values())} B allocated by the step and alive "
              f"- {freed} B of the earlier memory freed by then")
        for where, (size, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"   {size:>14} B  {n:>5} blocks  {where}")
        t.model = None
        del t
        torch.cuda.empty_cache()
    if len(groups) == 2:
        (a, ga), (b, gb) = groups.items()
        print(f"== by group, {a} - {b} (B), largest differences first")
        diff = {k: ga.get(k, 0) - gb.get(k, 0) for k in ga.keys() | gb.keys()}
        for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
            print(f"   {v:>14}  {k}")


if __name__ == "__main__":
    main()
