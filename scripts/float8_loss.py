"""Float8 loss curves on one GPU (issue 27's numerics on hardware): hsdp and FSDP2, each
with torchao float8 linears, trained side by side for ``--steps`` steps, two seeds each.

    torchrun --nproc-per-node 1 scripts/float8_loss.py --out out/float8_loss.json

One rank, a (1, 1) mesh: the float8 casts, scales, float8 all-gather path (a one-rank
gather) and FP8 matmuls run for real; what 2x2 sharding changes is checked on CPU by
``tests/dist/test_float8.py``. The model is a Llama (hidden 2048, 8 layers, 16 heads, 4 KV
heads, ffn 5632, vocab 32768, about 0.5 B parameters), bf16 parameters with fp32
reduction, AdamW (lr 6e-4 after 10 warm-up steps), gradients clipped to norm 1.0 by
torch's ``clip_grad_norm_`` for both. The data are learnable: each sequence walks a fixed
random successor table (next token = the table's entry with probability 0.8, else
uniform), so the loss falls from ln(32768) towards the walk's entropy. ``--seed`` draws
both the initial weights and the sequences.

Runs (``--runs``, comma separated ``NAME`` from ``RUNS``): float8 tensorwise with float8
all-gather (hsdp and FSDP2 + torchao, torchtitan's recipe), the same with every block
``torch.compile``d, rowwise float8 (no float8 all-gather, torchao allows it for
tensorwise only) and bf16. The JSON holds each run's per-step loss and ``compare``: per seed how
hsdp's curve differs from FSDP2's, beside how FSDP2's two seeds differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import hsdp
from hsdp.float8 import convert_to_float8
from hsdp_tools.bench.fsdp2 import shard_fsdp2
from hsdp_tools.models import LlamaConfig, build_model, lm_loss, shard_units

MODEL = LlamaConfig(vocab=32768, hidden=2048, heads=16, kv_heads=4, ffn=5632, layers=8,
                    seq=2048)
BATCH = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU (gloo): emulated float8


@dataclass(frozen=True)
class Run:
    library: str  # "hsdp" or "fsdp2"
    recipe: str | None  # torchao recipe ("tensorwise", "rowwise") or None: bf16
    compiled: bool = False


RUNS = {f"{lib}-{kind}": Run(lib, recipe, compiled)
        for lib in ("hsdp", "fsdp2")
        for kind, recipe, compiled in (("f8", "tensorwise", False),
                                       ("f8-compiled", "tensorwise", True),
                                       ("f8-rowwise", "rowwise", False),
                                       ("bf16", None, False))}


def _float8(model: nn.Module, recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig

    config = (Float8LinearConfig(enable_fsdp_float8_all_gather=True) if recipe == "tensorwise"
              else Float8LinearConfig.from_recipe_name(recipe))
    if DEVICE == "cpu":
        config = dataclasses.replace(config, emulate=True)
    # the output head stays bf16, as torchtitan's float8 converter leaves it
    return convert_to_float8(model, config, module_filter_fn=lambda _m, fqn: fqn != "head")


def _build(run: Run, mesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = build_model(MODEL)
    if run.recipe is not None:
        model = _float8(model, run.recipe)
    if run.compiled:
        for block in model.blocks:
            block.compile()
    units = shard_units(model)
    mp = hsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if run.library == "hsdp":
        for unit, reshard in [*units, (model, True)]:
            hsdp.fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    else:
        shard_fsdp2(model, units, mesh, mp)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=DEVICE == "cuda")
    return model, opt


def _batches(seed: int, steps: int) -> torch.Tensor:
    """``steps`` batches of walks on one successor table (the same for every seed)."""
    table = torch.randperm(MODEL.vocab, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    n = steps * BATCH
    walks = torch.empty(n, MODEL.seq, dtype=torch.long)
    walks[:, 0] = torch.randint(MODEL.vocab, (n,), generator=g)
    follow = torch.rand(n, MODEL.seq, generator=g) < 0.8
    noise = torch.randint(MODEL.vocab, (n, MODEL.seq), generator=g)
    for t in range(1, MODEL.seq):
        walks[:, t] = torch.where(follow[:, t], table[walks[:, t - 1]], noise[:, t])
    return walks.view(steps, BATCH, MODEL.seq)


def train(run: Run, mesh, seed: int, steps: int) -> dict:
    model, opt = _build(run, mesh, seed)
    data = _batches(seed, steps).to(DEVICE)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    refresh_scales = None  # torchao's one scale all-reduce for FSDP2 (hsdp does its own)
    if run.library == "fsdp2" and run.recipe == "tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp as refresh_scales
    losses, times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = lm_loss(model(data[step]), data[step])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if refresh_scales is not None:
            refresh_scales(model)
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes: the step's time is its wall time
        times.append(time.perf_counter() - t0)
    if run.library == "hsdp":
        hsdp.synchronize(model)
    return {"loss": losses, "median_step_ms": 1e3 * sorted(times[10:])[len(times[10:]) // 2],
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda"
            else None}


def _diff(a: list[float], b: list[float]) -> dict[str, float | int | None]:
    """How two loss curves differ: the mean |difference| over all steps and the last 50,
    and the first step (0-based) where they differ by more than 0.05."""
    d = [abs(x - y) for x, y in zip(a, b)]
    return {"mean_abs_diff": sum(d) / len(d), "mean_abs_diff_last50": sum(d[-50:]) / len(d[-50:]),
            "first_step_over_0.05": next((i for i, x in enumerate(d) if x > 0.05), None)}


def compare(results: dict[str, dict[int, dict]], seeds: list[int]) -> dict:
    """Per run kind X with both hsdp-X and fsdp2-X: per seed, how hsdp's curve differs from
    FSDP2's (``_diff``) and each one's mean loss over the last 50 steps; beside them how
    FSDP2's two seeds differ from each other (its run-to-run spread)."""
    out = {}
    for name, by_seed in results.items():
        if not name.startswith("hsdp-") or f"fsdp2-{name[5:]}" not in results:
            continue
        peer = results[f"fsdp2-{name[5:]}"]
        row: dict = {}
        for s in seeds:
            if s not in by_seed or s not in peer:
                continue
            a, b = by_seed[s]["loss"], peer[s]["loss"]
            row[f"seed {s}"] = _diff(a, b) | {"hsdp_last50": sum(a[-50:]) / len(a[-50:]),
                                              "fsdp2_last50": sum(b[-50:]) / len(b[-50:])}
        if len(seeds) >= 2 and all(s in peer for s in seeds[:2]):
            row["fsdp2 seed spread"] = _diff(peer[seeds[0]]["loss"], peer[seeds[1]]["loss"])
        out[name[5:]] = row
    return out


def _write(out: Path, results: dict[str, dict[int, dict]], seeds: list[int],
           steps: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": dataclasses.asdict(MODEL) | {"batch": BATCH}, "steps": steps, "seeds": seeds,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "runs": {n: {str(s): r for s, r in by.items()} for n, by in results.items()},
        "compare": compare(results, seeds)}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="hsdp-f8,fsdp2-f8,hsdp-bf16,fsdp2-bf16")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", "--json", dest="out", type=Path, required=True)
    args = p.parse_args()
    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    mesh = hsdp.init_mesh(1, 1, DEVICE)
    results: dict[str, dict[int, dict]] = {}
    for name in runs:
        for seed in seeds:
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            r = train(RUNS[name], mesh, seed, args.steps)
            results.setdefault(name, {})[seed] = r
            print(f"{name} seed {seed}: loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}, "
                  f"{r['median_step_ms']:.1f} ms/step, peak {r['peak_mem_gib']} GiB",
                  flush=True)
            assert all(math.isfinite(x) for x in r["loss"]), name
            # written after each run: a run cut off later keeps what was measured
            _write(args.out, results, seeds, args.steps)
    for kind, row in compare(results, seeds).items():
        print(kind, json.dumps(row))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
