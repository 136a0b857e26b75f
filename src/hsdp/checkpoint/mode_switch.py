"""Resuming in another outer-axis mode: what happens to the mode-specific state.

A checkpoint saved with one way of crossing the outer axis (exact reduction, a compressed
one with error-feedback residuals, DiLoCo) loads into a model set up with another, on the
same mesh or another, through ``hsdp.load``, torch DCP (``get_state_dict`` /
``dcp.load`` / ``set_state_dict``) and torchtitan's checkpointer. The parameters and the
optimizer's state always load (DCP reshards them); the mode-specific state follows one
rule (docs/guide/checkpoints.md):

- residuals saved, none in the model (int8 -> exact or DiLoCo): dropped;
- residuals in the model, none saved for its layout (exact / DiLoCo -> int8): zero
  (``hsdp.load`` converts those of another mesh or format instead, ``outer_residual.py``);
- DiLoCo state saved, no DiLoCo in the model (-> exact / int8): dropped; the parameters
  and optimizer state are outer replica 0's, as the checkpoint's DTensors hold them (at a
  sync every replica's equal the anchor; mid-period the other replicas' steps since the
  last sync and a pending outer step are lost);
- DiLoCo in the model, none saved for its layout (exact / int8 -> DiLoCo, or another
  mesh): afresh, the anchors taken from the loaded parameters, zero outer momentum, the
  period restarting.

None of it is silent: each load that drops or starts state afresh logs one line on rank 0
(``note``). For torch DCP this module extends ``DefaultLoadPlanner.set_up_planner`` (torch's
``dcp.load`` and torchtitan's checkpointer use it): an hsdp entry of the state dict that
the checkpoint lacks is taken out of the dict (whose set then starts it afresh) instead of
failing the whole load with DCP's "Missing key in checkpoint state_dict". The extension is
installed (``install``) the first time hsdp is asked for its entries of a state dict
(``extra_state.extra_state``), not at import: importing hsdp changes nothing of torch's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from hsdp.runtime.outer_modes import MODES
from hsdp.topology.outer_mode import OuterMode

log = logging.getLogger(__name__)

def stateful() -> dict[str, type[OuterMode]]:
    """State key -> the registered mode whose state it holds (the modes with state of
    their own; read at each call: a mode registered later counts)."""
    return {m.state_key: m for modes in MODES.values() for m in modes if m.state_key}


def kind(path: Iterable[Any]) -> str | None:
    """Which of hsdp's entries (a key of ``stateful()``) the state-dict path ``path`` (keys
    from the root; nested, or flattened as ``"KEY.key"``) lies in, or None."""
    for part in path:
        for key in stateful():
            if part == key or (isinstance(part, str) and part.startswith(key + ".")):
                return key
    return None


def saved_kinds(keys: Iterable[str]) -> set[str]:
    """The kinds of hsdp's entries among a checkpoint's (flattened) ``keys``."""
    return {k for k in (kind(key.split(".")) for key in keys) if k}


def note_read(where: str, saved_keys: Iterable[str], ours: dict[str, Any],
              targets: dict[str, Any]) -> None:
    """``note`` for ``hsdp.load``: ``ours``: the model's optimizer state dict (hsdp's
    entries where it has them); ``targets``: what it reads of them (empty: none saved
    for this layout)."""
    wanted = {k for k in stateful() if k in ours}
    note(where, saved_kinds(saved_keys), wanted, {k for k in wanted if not targets.get(k)})


class Quiet(DefaultLoadPlanner):
    """DCP's planner for a load whose targets are already what the checkpoint holds
    (``hsdp.load``, which notes the switch itself): nothing taken out, nothing noted."""

    quiet = True


def note(where: str, saved: set[str], wanted: set[str], missing: set[str]) -> None:
    """Log (rank 0) what a load does with the mode-specific state: ``saved``: the kinds
    the checkpoint holds; ``wanted``: those the model has; ``missing``: those of
    ``wanted`` the checkpoint lacks for this layout."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    modes = stateful()
    parts = ([modes[k].dropped_note for k in sorted(saved - wanted)]
             + [modes[k].fresh_note for k in sorted(missing)])
    if parts:
        log.warning("%s: the checkpoint was saved in another outer-axis mode or layout; %s",
                    where, "; ".join(parts))


def _without_missing(planner: DefaultLoadPlanner) -> None:
    """Take hsdp's entries that the checkpoint lacks out of ``planner``'s state dicts (the
    flattened one it plans with and the caller's, which the load's set then sees
    without them), and ``note`` what the load does."""
    saved_keys = planner.metadata.state_dict_metadata
    wanted, missing = set(), set()
    with_optimizer = False
    for fqn in list(planner.state_dict):
        path = planner.mappings.get(fqn, (fqn,))
        with_optimizer |= any(str(p).partition(".")[0] == "param_groups" for p in path)
        which = kind(path)
        if which is None:
            continue
        wanted.add(which)
        if fqn not in saved_keys:
            missing.add(which)
            del planner.state_dict[fqn]
            parent = planner.original_state_dict
            for part in path[:-1]:
                parent = parent[part]
            del parent[path[-1]]
    note("dcp.load", saved_kinds(saved_keys) if with_optimizer else set(), wanted, missing)


def _wrap_set_up(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_up_planner(self: DefaultLoadPlanner, state_dict: dict, metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        original(self, state_dict, metadata, is_coordinator)
        if metadata is not None and self.flatten_state_dict and not getattr(self, "quiet",
                                                                            False):
            _without_missing(self)

    set_up_planner._hsdp = True
    return set_up_planner


def install() -> None:
    """Extend ``DefaultLoadPlanner.set_up_planner`` (once; later calls do nothing)."""
    if not getattr(DefaultLoadPlanner.set_up_planner, "_hsdp", False):
        DefaultLoadPlanner.set_up_planner = _wrap_set_up(DefaultLoadPlanner.set_up_planner)
