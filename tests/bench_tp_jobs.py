"""Job of tests/dist/test_bench_step.py's TP parity: the step bench's TP plan for
``hsdp_tools.models``' Llama (``hsdp_tools.bench.tp_plan.apply_llama_tp_plan``) under hsdp and
FSDP2 on an
(outer, inner, tp) mesh, against the same model in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import hsdp
from hsdp_tools.bench.fsdp2 import shard_fsdp2
from hsdp_tools.bench.tp_plan import apply_llama_tp_plan
from hsdp_tools.bench.trainee import synthetic_batches
from hsdp_tools.models import LlamaConfig, build_model, lm_loss, shard_units

CFG = LlamaConfig(vocab=64, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, seq=8)
STEPS, ROWS, LR, MOMENTUM = 3, 4, 0.1, 0.9
MP = hsdp.MixedPrecision(None, None)


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CFG.vocab, (ROWS, CFG.seq), generator=g)


def _train(model: nn.Module, dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    """SGD with momentum on this data-parallel rank's rows of the global batch; every
    parameter whole afterwards."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    rows = ROWS // dp
    for step in range(STEPS):
        tokens = _tokens(step)[dp_rank * rows:(dp_rank + 1) * rows]
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in model.named_parameters()}


def parity_job(rank: int, world: int, sizes: tuple[int, int, int]) -> dict:
    """Relative error of each library's parameters after ``STEPS`` steps against one
    process; whether the bench's batches agree within each TP group."""
    outer, inner, tp = sizes
    mesh = hsdp.init_mesh(outer, inner, "cpu", tp=tp)
    dp_rank, dp = rank // tp, outer * inner
    torch.manual_seed(0)
    ref = _train(build_model(CFG), 0, 1)
    errs = {}
    for lib in ("hsdp", "hfsdp", "fsdp2"):
        torch.manual_seed(0)
        model = build_model(CFG)
        apply_llama_tp_plan(model, mesh["tp"])
        units = shard_units(model)
        if lib == "fsdp2":
            shard_fsdp2(model, units, mesh["outer", "inner"], MP)
        else:
            for unit, reshard in [*units, (model, True)]:
                hsdp.fully_shard(unit, mesh=mesh, strategy=lib, reshard_after_forward=reshard)
        got = _train(model, dp_rank, dp)
        assert got.keys() == ref.keys()
        errs[lib] = max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
    batch = synthetic_batches(CFG.vocab, 2, CFG.seq, 1, torch.device("cpu"), tp)[0]
    mine = [None] * world
    dist.all_gather_object(mine, batch)
    same_in_tp = all(torch.equal(mine[r], mine[r - r % tp]) for r in range(world))
    differ_over_dp = not torch.equal(mine[0], mine[tp])
    return {"errs": errs, "batches": (same_in_tp, differ_over_dp)}
