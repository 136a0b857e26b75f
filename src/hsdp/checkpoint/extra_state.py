"""hsdp's training state beyond the parameters and the optimizer's own state, as it travels
in optimizer state dicts: the compressed outer reduction's error-feedback residuals
(``outer_residual.KEY``) and DiLoCo's outer state and replica-local values
(``outer_sync_state.KEY``). Nested (``{KEY: {key: tensor}}``) or, in a flattened optimizer
state dict (torch's ``flatten_optimizer_state_dict``, torchtitan's), as ``"KEY.key"``: both
give DCP the same flattened keys.

Why the optimizer's state dict: only a resume needs this state (a model-only checkpoint,
an export, leaves it out), and DiLoCo's replica-local values include the optimizer's.
``state_dicts.py`` (hsdp's and torch's ``get_state_dict`` / ``set_state_dict``, through
``torch_state_dict.py``) and the torchtitan integration carry it with this module.

A load is checked before anything changes (``prepare``): a dict without any of it (a plain
model's, FSDP2's, a run without compression or DiLoCo) sets the residuals to zero and
starts DiLoCo afresh (anchors from the loaded parameters); a dict that has it but not this
rank's keys with this model's shapes (saved on another mesh or strategy) raises, as only
``hsdp.load`` converts it (``outer_residual.from_read``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from hsdp.checkpoint import mode_switch, outer_residual, outer_sync_state
from hsdp.checkpoint.outer_residual import load_residuals, residual_state
from hsdp.checkpoint.outer_sync_state import load_outer_sync

KEYS = (outer_residual.KEY, outer_sync_state.KEY)

OptState = Mapping[torch.Tensor, dict[str, Any]]


def merged_state(optimizers: Iterable[torch.optim.Optimizer]) -> dict[torch.Tensor, dict]:
    """Every optimizer's state, by parameter."""
    return {p: st for o in optimizers for p, st in o.state.items()}


def extra_state(model: nn.Module, opt_state: OptState | None) -> dict[str, dict[str, Any]]:
    """``{KEY: {key: tensor}}`` of ``model``'s residuals and DiLoCo state (copies; none
    for a model without them); ``opt_state``: the optimizer state by parameter, whose
    replica-local values DiLoCo saves. The first call extends DCP's load planner
    (``mode_switch.install``): a load of these entries may meet a checkpoint without them."""
    mode_switch.install()
    out = {outer_residual.KEY: residual_state(model),
           outer_sync_state.KEY: outer_sync_state.outer_sync_state(model, opt_state)}
    return {k: v for k, v in out.items() if v}


def flat(extras: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``extras`` as the keys of a flattened optimizer state dict."""
    return {f"{name}.{k}": v for name, part in extras.items() for k, v in part.items()}


def split(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(``state_dict`` without hsdp's entries, those entries nested), either form."""
    rest: dict[str, Any] = {}
    extras: dict[str, dict[str, Any]] = {}
    for k, v in state_dict.items():
        if k in KEYS and isinstance(v, Mapping):
            extras.setdefault(k, {}).update(v)
            continue
        name, dot, key = k.partition(".")
        if dot and name in KEYS:
            extras.setdefault(name, {})[key] = v
        else:
            rest[k] = v
    return rest, extras


@dataclass
class Loaded:
    """What ``apply`` sets: the residuals and DiLoCo state (None: none saved)."""

    residuals: dict[str, torch.Tensor] | None
    outer_sync: dict[str, torch.Tensor] | None


def _checked(part: Mapping[str, Any] | None, ours: dict[str, torch.Tensor], what: str,
             where: str) -> dict[str, torch.Tensor] | None:
    """``part`` (None if empty), once it holds every one of this rank's keys ``ours`` with
    its size; raises where one is missing or of another size."""
    if not part or not ours:
        return None
    for key, want in ours.items():
        got = part.get(key)
        if not torch.is_tensor(got) or got.numel() != want.numel():
            found = "missing" if got is None else f"of shape {tuple(getattr(got, 'shape', ()))}"
            raise ValueError(
                f"{where}: the {what} {key} is {found} in the optimizer state dict (this "
                f"model's: {tuple(want.shape)}); it was saved on another mesh, strategy or "
                f"model. Load the checkpoint with hsdp.load, which converts the "
                f"error-feedback residuals and starts DiLoCo afresh, or leave the "
                f"{', '.join(KEYS)} entries out of the dict (residuals from zero, DiLoCo "
                f"afresh). Nothing was changed.")
    return dict(part)


def prepare(model: nn.Module, extras: dict[str, dict[str, Any]], opt_state: OptState | None,
            where: str) -> Loaded:
    """Check ``extras`` (``split``'s) against ``model`` before anything changes."""
    ours = extra_state(model, opt_state)
    return Loaded(
        _checked(extras.get(outer_residual.KEY), ours.get(outer_residual.KEY, {}),
                 "error-feedback residual", where),
        _checked(extras.get(outer_sync_state.KEY), ours.get(outer_sync_state.KEY, {}),
                 "DiLoCo state", where))


def apply(model: nn.Module, loaded: Loaded, opt_state: OptState | None) -> None:
    """Set the residuals and DiLoCo state (after the optimizer's own load: DiLoCo's
    replica-local values replace what its entries held)."""
    load_residuals(model, loaded.residuals)
    load_outer_sync(model, loaded.outer_sync, opt_state)
