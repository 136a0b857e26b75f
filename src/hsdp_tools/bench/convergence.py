"""Loss curves of the exact and the compressed outer reduction, of hfsdp's compressed
outer parameter all-gather, and of DiLoCo, on real collectives.

``convergence_job`` runs inside a spawned world (gloo on CPU moves real data; torch's
fake process group would not): for each mesh (outer x inner over the whole world), seed
and run (``RUNS``: exact, int8 + error feedback, fp8 + error feedback, fp8 without;
hfsdp meshes: the int8 / fp8 outer all-gather, alone and with the int8 reduction;
DiLoCo with H in {1, 10, 50} and 1 or 4 fragments),
a small Llama trained with AdamW on learnable synthetic data, every rank on its own rows
of one global batch. Returns, per (mesh, seed, run), the loss of every step (mean over
the ranks). ``summarize`` turns that into the table of docs/benchmarks.md:
final-loss mean per mesh and run (the mean of the last ``tail`` steps, over seeds),
beside the exact runs' own spread over seeds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import hsdp
from hsdp_tools.models import LlamaConfig, build_model, lm_loss

MODEL = LlamaConfig(vocab=128, hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, seq=32)
ROWS_PER_RANK = 2
LR = 3e-3
# name -> fully_shard's outer_reduce / outer_gather (block 64: the model's groups are
# small; outer_gather: hfsdp meshes only) or init_mesh's outer_sync (DiLoCo: the paper's
# outer optimizer, Nesterov 0.9 at lr 0.7)
_INT8 = hsdp.OuterReduce("int8", block=64)
RUNS: dict[str, dict[str, object]] = {
    "exact": {},
    "int8+EF": {"outer_reduce": _INT8},
    "fp8+EF": {"outer_reduce": hsdp.OuterReduce("fp8_e4m3", block=64)},
    "fp8 no EF": {"outer_reduce": hsdp.OuterReduce("fp8_e4m3", block=64,
                                                   error_feedback=False)},
    "int8 gather": {"outer_gather": hsdp.OuterGather("int8", block=64)},
    "fp8 gather": {"outer_gather": hsdp.OuterGather("fp8_e4m3", block=64)},
    "int8+EF + int8 gather": {"outer_reduce": _INT8,
                              "outer_gather": hsdp.OuterGather("int8", block=64)},
    **{f"DiLoCo H{h} F{f}": {"outer_sync": hsdp.DiLoCo(inner_steps=h, fragments=f,
                                                       outer_lr=0.7, momentum=0.9)}
       for h in (1, 10, 50) for f in (1, 4)},
}


@dataclass(frozen=True)
class Plan:
    meshes: tuple[tuple[int, int, str], ...]  # (outer, inner, strategy)
    seeds: tuple[int, ...]
    runs: tuple[str, ...]
    steps: int
    layers: int = MODEL.layers  # DiLoCo with 4 fragments: 3 (3 blocks + the root: 4 units)


def _batch(step: int, seed: int, rows: int) -> torch.Tensor:
    """One global batch of walks on a fixed random successor table (next token = the
    table's entry with probability 0.8, else uniform): learnable, with a floor."""
    table = torch.randperm(MODEL.vocab, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    walks = torch.empty(rows, MODEL.seq, dtype=torch.long)
    walks[:, 0] = torch.randint(MODEL.vocab, (rows,), generator=g)
    follow = torch.rand(rows, MODEL.seq, generator=g) < 0.8
    noise = torch.randint(MODEL.vocab, (rows, MODEL.seq), generator=g)
    for t in range(1, MODEL.seq):
        walks[:, t] = torch.where(follow[:, t], table[walks[:, t - 1]], noise[:, t])
    return walks


def build(mesh: object, strategy: str, seed: int, layers: int = MODEL.layers,
          **compress: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model of ``seed`` sharded on ``mesh`` and its AdamW; ``compress``:
    fully_shard's ``outer_reduce`` / ``outer_gather``."""
    torch.manual_seed(seed)
    model = build_model(replace(MODEL, layers=layers))
    for block in model.blocks:  # units: each block, the root (embedding, head)
        hsdp.fully_shard(block, mesh=mesh, strategy=strategy, **compress)
    hsdp.fully_shard(model, mesh=mesh, strategy=strategy, **compress)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def train(mesh: object, strategy: str, seed: int, steps: int, layers: int = MODEL.layers,
          **compress: object) -> list[float]:
    """Loss per step (mean over every rank) of one run (``build``'s arguments)."""
    model, opt = build(mesh, strategy, seed, layers, **compress)
    losses = train_steps(model, opt, range(steps), seed)
    hsdp.synchronize(model)
    return losses


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range,
                seed: int = 0, microbatches: int = 1,
                max_norm: float | None = None) -> list[float]:
    """Train ``steps`` steps of ``_batch(step, seed)``, every rank on its own
    ``ROWS_PER_RANK`` rows (in ``microbatches`` pieces; gradients clipped to ``max_norm``
    with ``hsdp.clip_grad_norm_`` if given); the loss of each step, mean over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    losses = []
    for step in steps:
        pieces = _batch(step, seed, world * ROWS_PER_RANK)[rows].chunk(microbatches)
        total = torch.zeros(())
        for i, tokens in enumerate(pieces):
            with hsdp.microbatch(model, is_last=i == len(pieces) - 1):
                loss = lm_loss(model(tokens), tokens) / len(pieces)
                loss.backward()
            total += loss.detach()
        if max_norm is not None:
            hsdp.clip_grad_norm_(model, max_norm)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def convergence_job(rank: int, world: int, plan: Plan,
                    on_run: Callable[[str, list[float]], None] | None = None
                    ) -> dict[str, list[float]]:
    """Every (mesh, seed, run) of ``plan`` in this world; keys "4x2 hsdp/seed0/int8+EF".
    ``on_run(key, losses)`` is called after each run."""
    out = {}
    for outer, inner, strategy in plan.meshes:
        for seed in plan.seeds:
            for run in plan.runs:
                compress = dict(RUNS[run])
                mesh = hsdp.init_mesh(outer, inner, "cpu",
                                      outer_sync=compress.pop("outer_sync", None))
                key = f"{outer}x{inner} {strategy}/seed{seed}/{run}"
                out[key] = train(mesh, strategy, seed, plan.steps, plan.layers, **compress)
                if on_run is not None:
                    on_run(key, out[key])
    return out


def final_losses(curves: dict[str, list[float]], tail: int) -> dict[tuple[str, str], list]:
    """(mesh, run) -> the final loss (mean of the last ``tail`` steps) of each seed."""
    out: dict[tuple[str, str], list[float]] = {}
    for key, losses in curves.items():
        mesh, _, run = key.split("/")
        out.setdefault((mesh, run), []).append(statistics.fmean(losses[-tail:]))
    return out


def _curve_gap(curves: dict[str, list[float]], mesh: str, run: str) -> float:
    """The largest |loss - exact loss| of one step, over the seeds and steps of ``run``."""
    gaps = [max(abs(a - b) for a, b in zip(losses, curves[key.rsplit("/", 1)[0] + "/exact"]))
            for key, losses in curves.items() if key.startswith(mesh + "/")
            and key.endswith("/" + run)]
    return max(gaps)


def summarize(curves: dict[str, list[float]], tail: int = 20) -> list[dict]:
    """One row per (mesh, run): final-loss mean and spread over seeds, its difference to
    the exact runs' mean, the exact runs' spread over seeds, and the largest gap of one
    step's loss to the exact run of the same seed."""
    finals = final_losses(curves, tail)
    rows = []
    for (mesh, run), values in finals.items():
        exact = finals[(mesh, "exact")]
        spread = max(exact) - min(exact)
        mean = statistics.fmean(values)
        rows.append({"mesh": mesh, "run": run, "seeds": len(values), "final_mean": mean,
                     "final_min": min(values), "final_max": max(values),
                     "exact_spread": spread,
                     "vs_exact": mean - statistics.fmean(exact),
                     "max_step_gap": _curve_gap(curves, mesh, run)})
    return rows
