"""Multi-rank job for tests/dist/test_reductions.py: torch reductions on an hsdp model's
parameters, gradients and tensors computed from them, against the same model unsharded;
ops that depend on where elements lie (views, indexing, joins) refused on every rank.

The model's sizes leave some ranks without any element of some parameters (their local
tensor is a one-element placeholder), and a bias is all negative: the cases where reducing
the local tensors as DTensor does (as if they were torch.chunk rows) goes wrong."""

from __future__ import annotations

import torch
import torch.nn as nn

import hsdp

REDUCTIONS = {
    "sum": lambda t: t.sum(), "mean": lambda t: t.mean(), "max": lambda t: t.max(),
    "min": lambda t: t.min(), "amax": lambda t: torch.amax(t), "amin": lambda t: t.amin(),
    "prod": lambda t: (t * 0.1 + 1).prod(), "nansum": lambda t: torch.nansum(t),
    "norm": lambda t: t.norm(), "norm1": lambda t: t.norm(1),
    "norm_inf": lambda t: torch.linalg.vector_norm(t, float("inf")),
    "norm_-inf": lambda t: torch.linalg.vector_norm(t, float("-inf")),
    "norm0": lambda t: torch.linalg.vector_norm(t, 0), "norm3": lambda t: torch.norm(t, 3),
    "all": lambda t: (t > -0.9).all(), "any": lambda t: (t > 0.3).any(),
    "count_nonzero": lambda t: (t > 0).count_nonzero(),
    "sum_of_derived": lambda t: (t - 0.25).abs().sum(),
}
REFUSED = {
    "std": lambda t: t.std(), "argmax": lambda t: t.argmax(),
    "max(dim)": lambda t: t.max(dim=0), "sum(dim)": lambda t: t.sum(dim=0),
    "median": lambda t: torch.median(t), "index": lambda t: t[0], "slice": lambda t: t[1:],
    "view": lambda t: t.view(-1), "cat": lambda t: torch.cat([t, t]),
    "stack": lambda t: torch.stack([t, t]), "softmax": lambda t: torch.softmax(t, 0),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8),
                          nn.Linear(8, 3))
    with torch.no_grad():
        model[3].bias.copy_(torch.tensor([-0.5, -0.2, -0.3]))
    return model


def _backward(model: nn.Module, device: torch.device) -> None:
    tokens = torch.arange(22, device=device).remainder(11).view(2, 11)  # same on every rank
    model(tokens).square().mean().backward()


def reductions_job(rank: int, world: int, strategy: str,
                   device_type: str = "cpu") -> dict[str, bool]:
    """Each check's outcome on this rank (True: the unsharded model's value, or an hsdp
    error where one is expected)."""
    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda"
                          else None)
    # GPU: the sharded and unsharded gradients differ in summation order (1e-6 relative)
    tol = dict(rtol=1e-5, atol=1e-6) if device_type == "cpu" else dict(rtol=1e-4, atol=1e-5)

    def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        return a.shape == b.shape and torch.allclose(a.double(), b.double(), **tol)

    mesh = hsdp.init_mesh(2, 2, device_type)
    model, ref = _model().to(device), _model().to(device)
    hsdp.fully_shard(model, mesh=mesh, strategy=strategy)
    _backward(model, device)
    _backward(ref, device)
    named = list(zip(model.parameters(), ref.parameters()))
    out: dict[str, bool] = {}
    with torch.no_grad():
        for i, (p, q) in enumerate(named):
            for what, t, u in (("param", p, q), ("grad", p.grad, q.grad)):
                for name, fn in REDUCTIONS.items():
                    out[f"{i}.{what}.{name}"] = _close(fn(t), fn(u))
                for name, fn in REFUSED.items():
                    try:
                        fn(t)
                        out[f"{i}.{what}.refuses {name}"] = False
                    except RuntimeError as e:
                        out[f"{i}.{what}.refuses {name}"] = str(e).startswith("hsdp:")
        # A copy that is not the state dict's own tensor still loads in place (a clone has
        # no DCP hooks, but is still a piece laid out like the parameter).
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ema = [p.detach().clone() for p, _ in named]
        torch._foreach_mul_(ema, 0.5)
        for p, _ in named:
            nn.init.ones_(p)  # writes every local element, placeholders included
        out["sum after ones_"] = all(
            _close(p.sum(), torch.tensor(float(q.numel()), device=device)) for p, q in named)
        for p, q in named:  # an in-place op on the gradients, placeholders included
            p.grad.add_(1.0)
            q.grad.add_(1.0)
        for norm_type in (2.0, float("inf")):
            expected = nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=norm_type)
            out[f"clip_grad_norm_ {norm_type}"] = _close(
                nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type=norm_type),
                expected)
            out[f"hsdp.clip_grad_norm_ {norm_type}"] = _close(
                hsdp.clip_grad_norm_(model, 1e9, norm_type=norm_type), expected)
        out["ema full_tensor"] = all(_close(e, 0.5 * q) for e, (_, q) in zip(ema, named))
        model.load_state_dict(snapshot)
        out["load a cloned state dict"] = all(_close(p, q) for p, q in named)
    return out
