"""The optimizer state a parameter gets at its first step, built without stepping.

A state dict needs every parameter's optimizer state, so that ``dcp.load`` has tensors to
load into; a parameter that never had a gradient (unused in the forward, frozen so far, a
fresh optimizer) has none yet. Stepping the optimizer to create it (torch's
``_init_optim_state``: a step with lr 0 on zero gradients) also steps every parameter that
has state (AdamW's ``step`` + 1, its moments and SGD's momentum scaled), which changes
training. Here the state is built as torch's optimizers build it lazily, and only where a
saved and reloaded copy of it makes the next step exactly the first step torch would take:

- ``SGD``: nothing without momentum; with momentum a zero ``momentum_buffer`` (torch's first
  step sets it to the gradient, ``0 * momentum + grad`` is the same) unless ``dampening``
  is not 0 (then ``(1 - dampening) * grad``: not the same, so no state is built);
- ``Adam`` / ``AdamW``: ``step`` 0 (on the parameter's device when fused or capturable) and
  zero moments, exactly torch's lazy initialization.

Other optimizers: no state is built (``initial_state`` returns None).
"""

from __future__ import annotations

from typing import Any

import torch


def _scalar_dtype(fused: bool) -> torch.dtype:
    """The dtype torch's optimizers give ``step`` (``optimizer._get_scalar_dtype``)."""
    if fused or torch.get_default_dtype() != torch.float64:
        return torch.float32
    return torch.float64


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _sgd(group: dict[str, Any], p: torch.Tensor) -> dict[str, Any] | None:
    if group["momentum"] == 0:
        return {}
    if group["dampening"] != 0:
        return None
    return {"momentum_buffer": _zeros(p)}


def _adam(group: dict[str, Any], p: torch.Tensor) -> dict[str, Any] | None:
    fused = bool(group.get("fused"))
    if fused or group.get("capturable"):
        step = torch.zeros((), dtype=_scalar_dtype(fused), device=p.device)
    else:
        step = torch.tensor(0.0, dtype=_scalar_dtype(False), device="cpu")
    state = {"step": step, "exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = _zeros(p)
    return state


_BUILDERS = {torch.optim.SGD: _sgd, torch.optim.Adam: _adam, torch.optim.AdamW: _adam}


@torch.no_grad()
def initial_state(optimizer: torch.optim.Optimizer, group: dict[str, Any],
                  p: torch.Tensor) -> dict[str, Any] | None:
    """The state ``optimizer`` (whose param group ``group`` holds ``p``) would create at
    ``p``'s first step, or None when it cannot be built exactly (see the module). Nothing is
    stored in the optimizer."""
    build = _BUILDERS.get(type(optimizer))
    return None if build is None else build(group, p)


def supported() -> str:
    """The optimizers whose initial state can be built, for messages."""
    return ", ".join(sorted(cls.__name__ for cls in _BUILDERS))
