"""The pieces of a unit's module hooks that every part of the runtime uses: the autograd
node that runs after a unit's backward, input and output casts, and unit lookup."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from hsdp.sharding.reductions import ENTRY_POINTS

if TYPE_CHECKING:
    from hsdp.runtime.gather import Gathering
    from hsdp.runtime.schedule import Schedule
    from hsdp.runtime.unit import Unit


def in_backward() -> bool:
    """True while the autograd engine runs (activation-checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


def outside_root(unit: Unit) -> str:
    root = unit
    while root.enclosing is not None:
        root = root.enclosing
    return (f"hsdp: forward of {unit.label} outside the forward of the model it belongs to "
            f"({root.label}, the outermost fully_shard-ed module): hsdp gathers a unit's "
            f"parameters only inside that forward. Call the model itself (nothing has been "
            f"changed; the model can still be used).{ENTRY_POINTS}")


def cast(t: Any, dtype: torch.dtype) -> Any:
    """``t`` cast to ``dtype`` if it is a floating-point tensor of another dtype."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype`` (a lone tensor, the
    common block output, without the pytree round trip)."""
    if isinstance(tree, torch.Tensor):
        return cast(tree, dtype)
    return tree_map_only(torch.Tensor, lambda t: cast(t, dtype), tree)


def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    if plain_call(args, kwargs):  # the common block call: no pytree round trip
        return tuple(cast(a, dtype) for a in args), kwargs
    return cast_floats((args, kwargs), dtype)


def units_below(module: nn.Module) -> Iterator[Unit]:
    for m in module.modules():
        # vars, not getattr: a torch.compile wrapper forwards attribute reads to the module
        # it wraps, which would yield that module's unit twice.
        unit = vars(m).get("_hsdp_unit")
        if unit is not None:
            yield unit


_LEAVES = (torch.Tensor, int, float, bool, str, type(None))  # never pytree containers


def plain_call(args: tuple, kwargs: dict) -> bool:
    """Tensors and scalars only, no keywords (the common block call): hooks can handle
    such a call without a pytree round trip, which costs tens of us per call."""
    return not kwargs and all(isinstance(a, _LEAVES) for a in args)


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, schedule: Schedule, unit: Unit, *inputs: torch.Tensor):
        ctx.schedule, ctx.unit = schedule, unit
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.schedule.post_backward(ctx.unit)
        return (None, None, *grads)


class UnshardHandle:
    """``module.unshard(async_op=True)``'s result: ``wait()`` makes compute wait for the
    all-gather and shows the unsharded parameters on the module."""

    def __init__(self, gathering: Gathering, unit: Unit) -> None:
        self.gathering, self.unit = gathering, unit

    def wait(self) -> None:
        self.gathering.unshard_now(self.unit)
