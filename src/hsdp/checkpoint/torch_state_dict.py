"""torch's full-state-dict loads on hsdp's Pieces.

``torch.distributed.checkpoint.state_dict.set_model_state_dict`` /
``set_optimizer_state_dict`` (and ``set_state_dict``) with ``full_state_dict=True`` (each
rank passes the full dict) or ``broadcast_from_rank0=True`` (rank 0 passes it, the others
``{}``) cut every full tensor into the ``torch.chunk`` rows that its DTensor's placements
imply (``_state_dict_utils._distribute_tensors`` / ``_distribute_state_dict``). A Piece
holds a flat range of the tensor instead (``sharding/pieces.py``), so those rows do not
fit its local tensor. hsdp wraps both functions: each Piece gets its range of the full
tensor copied into its local tensor in place (memory as torch's: one full tensor at a time
when broadcast), every other entry goes through torch's code unchanged. Before anything is
written, the full dict is checked against the model (shapes; in a strict load, keys the
model lacks) on rank 0 (or on each rank that holds it) and a mismatch raises on every
rank: torch checks each tensor only once it arrives, after earlier ones were written, and
raises a strict load's unexpected key on rank 0 alone while the other ranks go on.

The outer modes' state (``extra_state.py``) travels in the optimizer state dicts
that ``get_optimizer_state_dict`` / ``get_state_dict`` return (torch's code keeps only
``state`` and ``param_groups`` of ``optimizer.state_dict()``) and are set by
``set_optimizer_state_dict`` / ``set_state_dict``, checked before the optimizer is
written. A full optimizer state dict (the same on every rank) cannot hold what is each
rank's own (a mode's ``full_state_refusal``): asking for one of a model that has it
raises.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._state_dict_utils as sd_utils
import torch.distributed.checkpoint.state_dict as torch_sd
import torch.nn as nn

from hsdp.checkpoint import extra_state
from hsdp.checkpoint.full_state import quiesce
from hsdp.sharding.pieces import Piece
from hsdp.sharding.tp_blocks import block_of


def _mismatch(full_state_dict: dict[str, Any], local_state_dict: dict[str, Any],
              strict: bool) -> str | None:
    """The first way ``full_state_dict`` does not fit the model's ``local_state_dict``: a
    tensor of another shape, or (``strict``) a key the model lacks."""
    for key, value in full_state_dict.items():
        local = local_state_dict.get(key)
        if torch.is_tensor(value) and torch.is_tensor(local) and value.shape != local.shape:
            return (f"hsdp: {key} has shape {tuple(value.shape)} in the full state dict, the "
                    f"model's is {tuple(local.shape)}")
    extra = sorted(set(full_state_dict) - set(local_state_dict)) if strict else []
    return f"hsdp: unexpected key(s) in the full state dict: {extra}" if extra else None


@torch.no_grad()
def _fill(piece: Piece, full: torch.Tensor) -> None:
    """Copy ``piece``'s range of the full tensor ``full`` (of its TP block, where TP
    shards it) into its local tensor."""
    start, length = piece._hsdp_range
    block = block_of(piece._spec)
    full = full if block is None else block.local_of(full)
    piece._local_tensor.reshape(-1)[:length].copy_(full.reshape(-1)[start:start + length])


def _wrap_distribute_tensors(original: Callable) -> Callable:
    @functools.wraps(original)
    def distribute_tensors(local_state_dict: dict[str, Any], keys: list[str], *args: Any,
                           **kwargs: Any) -> None:
        rest = []
        for key in keys:
            entry = local_state_dict.get(key)  # (local DTensor, full tensor) to distribute
            if isinstance(entry, tuple) and isinstance(entry[0], Piece):
                _fill(entry[0], entry[1])
                local_state_dict[key] = entry[0]
            else:
                rest.append(key)
        original(local_state_dict, rest, *args, **kwargs)

    return distribute_tensors


def _wrap_distribute_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def distribute_state_dict(full_state_dict: dict[str, Any],
                              local_state_dict: dict[str, Any], *args: Any,
                              **kwargs: Any) -> None:
        error = _mismatch(full_state_dict, local_state_dict, strict=False)
        if error is not None:  # before anything is written (each rank has the full dict)
            raise ValueError(error)
        mine = {k for k, v in full_state_dict.items()
                if isinstance(local_state_dict.get(k), Piece) and torch.is_tensor(v)
                and v.dim() > 0}
        for key in mine:
            _fill(local_state_dict[key], full_state_dict[key])
        original({k: v for k, v in full_state_dict.items() if k not in mine},
                 local_state_dict, *args, **kwargs)

    return distribute_state_dict


def _wrap_broadcast_state_dict(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def broadcast_state_dict(*args: Any, **kwargs: Any) -> None:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        # Only rank 0 holds the full dict: torch checks each tensor as it arrives (after
        # earlier ones were written) and a key the model lacks makes its strict load raise
        # on rank 0 alone (the others go on into their next collective). Checked on rank 0
        # first, raised on every rank before anything is written.
        error = [_mismatch(a["full_state_dict"], a["local_state_dict"], a["strict"])
                 if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(error, src=0, group=a["pg"])
        if error[0] is not None:
            raise ValueError(error[0])
        original(*args, **kwargs)

    return broadcast_state_dict


def _wrap_get_optim_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_optim_state_dict(model: nn.Module, optimizers: tuple, info: Any) -> dict:
        out = original(model, optimizers, info)
        if not info.handle_optim:
            return out
        quiesce(model, "get_optimizer_state_dict")
        extras = extra_state.extra_state(model, extra_state.merged_state(optimizers))
        refusals = extra_state.full_refusals(model, extras) if info.full_state_dict else []
        if refusals:
            raise ValueError(
                f"hsdp: a full optimizer state dict (StateDictOptions(full_state_dict=True)) "
                f"cannot hold this model's {' and '.join(refusals)}; use the sharded one "
                f"(the default) with torch.distributed.checkpoint, or hsdp.save")
        out.update(extra_state.flat(extras) if info.flatten_optimizer_state_dict else extras)
        return out

    return get_optim_state_dict


def _wrap_load_optim_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_optim_state_dict(model: nn.Module, optimizers: tuple, state_dict: dict,
                              info: Any) -> None:
        if not info.handle_optim:
            return original(model, optimizers, state_dict, info)
        quiesce(model, "set_optimizer_state_dict")
        rest, extras = extra_state.split(state_dict)
        live = extra_state.merged_state(optimizers)
        loaded = extra_state.prepare(model, extras, live, "set_optimizer_state_dict")
        original(model, optimizers, rest, info)
        extra_state.apply(model, loaded, extra_state.merged_state(optimizers))
        return None

    return load_optim_state_dict


def install() -> None:
    """Wrap torch's functions above (once; the first ``fully_shard`` calls this: importing
    hsdp changes nothing of torch's, and before it no Piece exists)."""
    if getattr(sd_utils._distribute_tensors, "_hsdp", False):
        return
    for module, name, wrap in (
            (sd_utils, "_distribute_tensors", _wrap_distribute_tensors),
            (sd_utils, "_distribute_state_dict", _wrap_distribute_state_dict),
            # state_dict.py calls the name it imported
            (torch_sd, "_distribute_state_dict", _wrap_distribute_state_dict),
            (torch_sd, "_broadcast_state_dict", _wrap_broadcast_state_dict),
            (torch_sd, "_get_optim_state_dict", _wrap_get_optim_state_dict),
            (torch_sd, "_load_optim_state_dict", _wrap_load_optim_state_dict)):
        wrapped = wrap(getattr(module, name))
        wrapped._hsdp = True
        setattr(module, name, wrapped)
