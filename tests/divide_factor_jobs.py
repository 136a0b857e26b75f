"""Multi-rank job for tests/dist/test_divide_factor.py: ``set_gradient_divide_factor`` gives the
sums of the DP ranks' gradients divided by the factor (FSDP2's meaning), against the
same sums computed by one process, for both strategies, with and without microbatches,
and when set on a meta-built model before ``hsdp.materialize``."""

from __future__ import annotations

import torch
import torch.nn as nn

import hsdp

ROWS = 2  # rows per rank and microbatch


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5))


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        m.reset_parameters()


def _data(world: int, microbatches: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(microbatches, world, ROWS, 6, generator=g)


def _reference(world: int, microbatches: int, factor: float | None) -> list[torch.Tensor]:
    """sum over microbatches and ranks of each rank's gradient, divided by ``factor``
    (None: by the number of ranks)."""
    ref = _model()
    x = _data(world, microbatches)
    for mb in range(microbatches):
        for r in range(world):
            ref(x[mb, r]).square().mean().backward()
    div = world if factor is None else factor
    return [p.grad / div for p in ref.parameters()]


def divide_factor_job(rank: int, world: int) -> dict[str, float]:
    """The largest relative gradient error of each configuration on this rank."""
    mesh = hsdp.init_mesh(2, 2, "cpu")
    out: dict[str, float] = {}
    for strategy in ("hsdp", "hfsdp"):
        for microbatches in (1, 2):
            for factor in (1.0, 3.0, None):
                for meta in (False, True) if factor == 1.0 else (False,):
                    model = _model("meta" if meta else "cpu")
                    hsdp.fully_shard(model[0], mesh=mesh, strategy=strategy)
                    hsdp.fully_shard(model, mesh=mesh, strategy=strategy)
                    if factor is not None:
                        model.set_gradient_divide_factor(factor)
                    if meta:  # the factor survives materialize's rebuilt groups
                        torch.manual_seed(0)
                        hsdp.materialize(model, _init)
                    x = _data(world, microbatches)
                    for mb in range(microbatches):
                        with hsdp.microbatch(model, is_last=mb == microbatches - 1):
                            model(x[mb, rank]).square().mean().backward()
                    want = _reference(world, microbatches, factor)
                    err = max(((p.grad.full_tensor() - w).abs().max() / w.abs().max()).item()
                              for p, w in zip(model.parameters(), want))
                    out[f"{strategy} mb={microbatches} factor={factor} meta={meta}"] = err
    hsdp.synchronize(model)
    return out
