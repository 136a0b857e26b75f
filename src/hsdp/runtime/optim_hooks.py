"""The process-wide optimizer hooks: which models' ``OptimizerSteps`` (``optim_steps.py``)
run around each step of an optimizer that holds fully_shard-ed parameters. Registries:
``STEPPERS`` (every live model's, weak), the optimizers seen and given hooks (weak), and
the one global pre-step hook, installed by the first fully_shard (torch's optimizer hook
registry is process-wide, so this is too)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hsdp.runtime.optim_steps import OptimizerSteps
from hsdp.sharding.group import owner

# Process-wide: torch's optimizer-step hook is global; it finds the models here (weak).
STEPPERS: weakref.WeakSet[OptimizerSteps] = weakref.WeakSet()  # each model's (runtime.py)

# Process-wide: torch's global optimizer hook (``_detect``) sees every optimizer (weak).
# optimizer -> its number of parameters when ``_detect`` last looked at it
_SEEN: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_ATTACHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_DETECTOR: list = []  # the handle of ``_detect``, once the first fully_shard installed it


def watch_optimizers() -> None:
    """Find the optimizers that step fully_shard-ed parameters (the first fully_shard calls
    this; importing hsdp installs nothing). One global pre-step hook looks at each
    optimizer once (again when its parameters change): it refuses an optimizer built
    before fully_shard and gives one that holds hsdp's parameters hsdp's own step hooks
    (``attach_optimizer``), which run from that step on."""
    if not _DETECTOR:
        _DETECTOR.append(register_optimizer_step_pre_hook(_detect))


def _detect(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = [p for pg in optimizer.param_groups for p in pg["params"]]
    if _SEEN.get(optimizer) == len(params):
        return
    stale = sum(getattr(p, "_hsdp_moved_to", None) is not None for p in params)
    if stale:
        raise RuntimeError(
            f"hsdp: this optimizer holds {stale} parameter(s) that fully_shard has replaced by "
            f"their shards, so its step would not change the model. Build the optimizer after "
            f"fully_shard, from model.parameters().")
    _SEEN[optimizer] = len(params)
    if any(owner(p) is not None for p in params):
        attach_optimizer(optimizer)  # torch runs its hooks from this step on


def attach_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` hsdp's step hooks: before the step, abandon a failed step and
    check the gradients are final and the state matches the sharding; after it, adopt the
    state and (hfsdp) issue the outer all-gather. Done at the optimizer's first step;
    calling it earlier puts hsdp's pre-step hook before hooks registered later. A
    container of optimizers (an optimizer with a list ``optimizers`` whose step runs
    theirs, as torchtitan's ``OptimizersContainer``) gets none: its optimizers get them,
    else each step would run them twice (hfsdp: every outer all-gather twice)."""
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, list) and inner and all(
            isinstance(o, torch.optim.Optimizer) for o in inner):
        for o in inner:
            attach_optimizer(o)
        return
    if optimizer not in _ATTACHED:
        _ATTACHED.add(optimizer)
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)


def steppers_of(optimizer: torch.optim.Optimizer) -> list[OptimizerSteps]:
    """The models whose parameters ``optimizer`` holds, in the order of their first
    parameter in it: the same on every rank. Why not ``STEPPERS``' order: a set's order
    follows object addresses, which differ between ranks, and the models' collectives
    after the step (hfsdp's outer all-gathers of a rank's pipeline stages, which share
    communicators) must be issued in one order everywhere."""
    params = [id(p) for pg in optimizer.param_groups for p in pg["params"]]
    first = {}
    for steps in list(STEPPERS):
        at = next((i for i, p in enumerate(params) if p in steps.param_ids), None)
        if at is not None:
            first[steps] = at
    return sorted(first, key=first.__getitem__)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for steps in steppers_of(optimizer):
        steps.ctx.outer.check_optimizer(optimizer)
        steps.before_step()
        steps.check_optimizer_state(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for steps in steppers_of(optimizer):
        steps.after_step(optimizer)
