"""The compressed outer reduction's error-feedback residuals in checkpoints.

A residual is what quantization dropped from one rank's gradient: no other rank holds it,
and it is not laid out like any parameter. So each rank saves its own, a plain fp32
tensor over its group's inner shard, in the optimizer's state dict under ``KEY``, keyed
by unit, group, mesh shape and this rank's mesh coordinates ("blocks.0/0@2x2x1:1-0-0").
Resuming on the same mesh restores every residual bit for bit. A checkpoint of another
mesh shape (or one saved without compression) has none of this rank's keys: the
residuals start at zero, which drops at most one step's quantization error.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from hsdp.checkpoint.full_state import clean_key
from hsdp.runtime.hooks import units_below
from hsdp.sharding.group import ParamGroup

KEY = "hsdp_outer_residual"


def _groups(model: nn.Module) -> Iterator[tuple[str, ParamGroup]]:
    """(key, group) of every group of ``model`` with an error-feedback residual."""
    names = {id(m): clean_key(n) for n, m in model.named_modules()}
    for unit in units_below(model):
        for g in unit.groups:
            if g.compressed is None or not g.compressed.config.error_feedback:
                continue
            c = g.comms
            t = 0 if c.host_tp is None else dist.get_rank(c.host_tp)
            where = f"{c.outer_size}x{c.inner_size}x{c.tp_size}:{c.outer_rank}-{c.inner_rank}-{t}"
            yield f"{names.get(id(unit.module), unit.label)}/{g.label.rsplit('/', 1)[1]}@{where}", g


def residual_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's residuals (copies), by key."""
    return {key: g.compressed.residual_flat() for key, g in _groups(model)}


def load_residuals(model: nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Set this rank's residuals from ``state`` (``residual_state``'s form); a group
    whose key is missing starts from zero."""
    state = state or {}
    for key, g in _groups(model):
        g.compressed.load_residual(state.get(key))


def in_checkpoint(state: dict[str, torch.Tensor], saved: dict[str, object],
                  prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``state`` that the checkpoint's metadata ``saved`` (DCP's flattened
    keys, ``prefix`` + key) holds with the same shape: the ones to load."""
    return {k: v for k, v in state.items()
            if tuple(getattr(saved.get(prefix + k), "size", ())) == tuple(v.shape)}
