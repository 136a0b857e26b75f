"""hsdp's training state beyond the parameters and the optimizer's own state, as it travels
in optimizer state dicts: the outer modes' (``topology/outer_mode.py``: what a mode
keeps between steps, e.g. a codec's error feedback or an outer optimizer), one entry per
mode's ``state_key``, each group's values under "<unit>/<group>@<the mode's key>".
Nested (``{state_key: {key: tensor}}``) or, in a flattened optimizer state dict (torch's
``flatten_optimizer_state_dict``, torchtitan's), as ``"state_key.key"``: both give DCP
the same flattened keys.

This module walks the model's groups and their modes and keys the entries; what a mode
saves, loads, converts and refuses is its hooks'. Why the optimizer's state dict: only a
resume needs this state (a model-only checkpoint, an export, leaves it out), and a mode's
replica-local values may include the optimizer's. ``state_dicts.py`` (hsdp's and
torch's ``get_state_dict`` / ``set_state_dict``, through ``torch_state_dict.py``),
``dcp.py`` and the torchtitan integration carry it with this module.

A load is checked before anything changes (``prepare``): a dict without a mode's entry (a
plain model's, FSDP2's, a run without that mode) starts that state afresh
(``load_state_dict`` with no entries); a dict that has it but not this rank's
keys with this model's shapes (saved on another mesh or strategy) raises, as only
``hsdp.load`` converts it (``to_read`` / ``from_read``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.nn as nn

from hsdp.checkpoint import mode_switch
from hsdp.checkpoint.full_state import clean_key
from hsdp.runtime.hooks import units_below
from hsdp.runtime.outer_modes import MODES
from hsdp.sharding.group import ParamGroup
from hsdp.topology.outer_mode import OuterMode

OptState = Mapping[torch.Tensor, dict[str, Any]]
Loaded = dict[str, dict[str, Any]]  # checked entries by state key (absent: none saved)
V = TypeVar("V")


def keys() -> set[str]:
    """The state-dict entries of the registered modes."""
    return {m.state_key for modes in MODES.values() for m in modes if m.state_key}


def stateful(model: nn.Module) -> Iterator[tuple[str, ParamGroup, OuterMode]]:
    """(name "<unit>/<group>", group, mode) of every mode with state of every group."""
    names = {id(m): clean_key(n) for n, m in model.named_modules()}
    for unit in units_below(model):
        for g in unit.groups:
            name = f"{names.get(id(unit.module), unit.label)}/{g.label.rsplit('/', 1)[1]}"
            for mode in g.outer:
                if mode.state_key:
                    yield name, g, mode


def _by_group(part: Mapping[str, V]) -> dict[str, dict[str, V]]:
    """``part``'s entries ("<name>@<key>") by group name, then key."""
    out: dict[str, dict[str, V]] = {}
    for k, v in part.items():
        name, _, key = k.partition("@")
        out.setdefault(name, {})[key] = v
    return out


def _each(model: nn.Module, parts: Mapping[str, Mapping[str, V]]
          ) -> Iterator[tuple[str, ParamGroup, OuterMode, dict[str, V]]]:
    """``stateful``'s (name, group, mode) with the group's entries in ``parts`` (by state
    key; {} where none)."""
    grouped = {key: _by_group(part) for key, part in parts.items()}
    for name, g, mode in stateful(model):
        yield name, g, mode, grouped.get(mode.state_key, {}).get(name, {})


def _add(out: dict[str, dict[str, V]], mode: OuterMode, name: str,
         entries: Mapping[str, V]) -> None:
    out.setdefault(mode.state_key, {}).update((f"{name}@{k}", v) for k, v in entries.items())


def merged_state(optimizers: Iterable[torch.optim.Optimizer]) -> dict[torch.Tensor, dict]:
    """Every optimizer's state, by parameter."""
    return {p: st for o in optimizers for p, st in o.state.items()}


def extra_state(model: nn.Module, opt_state: OptState | None) -> dict[str, dict[str, Any]]:
    """``{state_key: {key: tensor}}`` of ``model``'s modes (copies; none for a model
    without them); ``opt_state``: the optimizer state by parameter. The first call
    extends DCP's load planner (``mode_switch.install``): a load of these entries may meet
    a checkpoint without them."""
    mode_switch.install()
    out: dict[str, dict[str, Any]] = {}
    for name, g, mode in stateful(model):
        entries = mode.state_dict(g, opt_state)
        if entries:
            _add(out, mode, name, entries)
    return out


def full_refusals(model: nn.Module, extras: Mapping[str, Any]) -> list[str]:
    """Why a full optimizer state dict cannot hold ``extras`` (``extra_state``'s), by
    mode."""
    return sorted({why for _, _, mode in stateful(model) if mode.state_key in extras
                   and (why := mode.full_state_refusal()) is not None})


def flat(extras: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``extras`` as the keys of a flattened optimizer state dict."""
    return {f"{name}.{k}": v for name, part in extras.items() for k, v in part.items()}


def split(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(``state_dict`` without hsdp's entries, those entries nested), either form."""
    ours = keys()
    rest: dict[str, Any] = {}
    extras: dict[str, dict[str, Any]] = {}
    for k, v in state_dict.items():
        if k in ours and isinstance(v, Mapping):
            extras.setdefault(k, {}).update(v)
            continue
        name, dot, key = k.partition(".")
        if dot and name in ours:
            extras.setdefault(name, {})[key] = v
        else:
            rest[k] = v
    return rest, extras


def _checked(part: Mapping[str, Any] | None, ours: dict[str, torch.Tensor], key: str,
             what: str, where: str) -> dict[str, torch.Tensor] | None:
    """``part`` (None if empty), once it holds every one of this rank's entries ``ours``
    with its size; raises where one is missing or of another size."""
    if not part or not ours:
        return None
    for entry, want in ours.items():
        got = part.get(entry)
        if not torch.is_tensor(got) or got.numel() != want.numel():
            found = "missing" if got is None else f"of shape {tuple(getattr(got, 'shape', ()))}"
            raise ValueError(
                f"{where}: {entry} of the {what} is {found} in the optimizer state dict "
                f"(this model's: {tuple(want.shape)}); it was saved on another mesh, "
                f"strategy or model. Load the checkpoint with hsdp.load, which converts or "
                f"restarts it for this model, or leave the {key} entries out of the dict "
                f"(it then starts afresh). Nothing was changed.")
    return dict(part)


def prepare(model: nn.Module, extras: dict[str, dict[str, Any]], opt_state: OptState | None,
            where: str) -> Loaded:
    """Check ``extras`` (``split``'s) against ``model`` before anything changes."""
    names = {mode.state_key: mode.state_name for _, _, mode in stateful(model)}
    out: Loaded = {}
    for key, ours in extra_state(model, opt_state).items():
        part = _checked(extras.get(key), ours, key, names[key], where)
        if part is not None:
            out[key] = part
    return out


def apply(model: nn.Module, loaded: Loaded, opt_state: OptState | None) -> None:
    """Set each mode's state from ``loaded`` (``prepare``'s; none saved: afresh), after the
    optimizer's own load (a mode's replica-local values replace what its entries held)."""
    for _, g, mode, entries in _each(model, loaded):
        mode.load_state_dict(g, entries, opt_state)


def restore_after_model_load(model: nn.Module, loaded: Loaded,
                             opt_state: OptState | None) -> None:
    """After a model load of the same checkpoint that followed ``apply``: put back what
    it wrote over (``OuterMode.restore_after_model_load``)."""
    for _, g, mode, entries in _each(model, loaded):
        mode.restore_after_model_load(g, entries, opt_state)


def to_read(model: nn.Module, ours: Mapping[str, Any], saved: Mapping[str, Any],
            prefix: str) -> dict[str, dict[str, torch.Tensor]]:
    """What ``hsdp.load`` reads of the modes' state, by state key, from a checkpoint whose
    DCP metadata is ``saved`` (flattened keys: ``prefix`` + "state_key.entry");
    ``ours``: this rank's entries (``extra_state``'s)."""
    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in ours if key in keys()}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for k, md in saved.items():
        key, _, entry = k[len(prefix):].partition(".")
        if k.startswith(prefix) and key in out and getattr(md, "size", None) is not None:
            shapes.setdefault(key, {})[entry] = tuple(md.size)
    grouped = {key: _by_group(part) for key, part in shapes.items()}
    for name, g, mode, mine in _each(model, {k: v for k, v in ours.items() if k in out}):
        if mode.state_key in out:
            saved_here = grouped.get(mode.state_key, {}).get(name, {})
            _add(out, mode, name, mode.to_read(g, mine, saved_here))
    return out


def from_read(model: nn.Module, read: Mapping[str, Any]) -> Loaded:
    """Each mode's state from ``to_read``'s entries once read (in ``read``, the optimizer's
    part): ``apply``'s input."""
    parts = {k: v for k, v in read.items() if k in keys()}
    out: Loaded = {key: {} for key in parts}
    for name, g, mode, entries in _each(model, parts):
        if mode.state_key in out:
            _add(out, mode, name, mode.from_read(g, entries))
    return out
