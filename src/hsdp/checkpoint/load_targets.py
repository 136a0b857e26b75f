"""What ``hsdp.load`` reads into, and the checks that decide, before anything is read or
written, whether a checkpoint fits the model and optimizer.

The model's part is the model's own state dict (views of its pieces, read in place): every
tensor must be in the checkpoint with the same global shape and dtype, and the checkpoint
may hold no model tensor the model lacks. The optimizer's part follows the checkpoint, not
the optimizer: for each parameter the checkpoint holds state for, the optimizer's live
tensor of that key where it has one of the same shape and dtype (read in place), else a new
one laid out like the parameter. So a load restores exactly the saved state (a parameter
saved without state gets none, whatever the optimizer held) for any optimizer, and nothing
has to be created in the optimizer first. The parameter groups are bytes in the checkpoint:
``check_groups`` compares them once read, still before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from hsdp.sharding.group import owner

STATE = "optim.state."
GROUPS = "optim.param_groups"


def tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(flattened DCP key, tensor) for every tensor in nested dicts."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, torch.Tensor):
        yield prefix, obj


def check_model(path: str, model_sd: dict[str, Any], saved: dict[str, Any]) -> None:
    """Every model tensor is in the checkpoint with the same global shape and dtype, and the
    checkpoint holds no model tensor the model lacks."""
    ours = dict(tensors(model_sd, "model"))
    for key, t in ours.items():
        md = saved.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"hsdp.load: {key} is not in the checkpoint at {path}")
        if tuple(md.size) != tuple(t.shape):
            raise ValueError(f"hsdp.load: {key} has shape {tuple(md.size)} in the checkpoint "
                             f"at {path}, {tuple(t.shape)} here")
        if md.properties.dtype != t.dtype:
            raise ValueError(f"hsdp.load: {key} is {md.properties.dtype} in the checkpoint at "
                             f"{path}, {t.dtype} here")
    _no_extra(path, [k for k, md in saved.items() if k.startswith("model.")
                     and isinstance(md, TensorStorageMetadata) and k not in ours])


def _no_extra(path: str, extra: list[str]) -> None:
    if extra:
        extra.sort()
        raise KeyError(f"hsdp.load: the checkpoint at {path} has {extra[0]}, which this model "
                       f"(or optimizer) lacks" + (f" (and {len(extra) - 1} more)"
                                                  if len(extra) > 1 else ""))


def optim_targets(path: str, ours: dict[str, Any], params: dict[str, nn.Parameter],
                  saved: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's part of the load: ``ours`` is the optimizer's state dict (views of its
    live state, keyed by parameter name; ``dcp.optim_state_dict``), ``params`` its
    parameters by name. Raises on a checkpoint without optimizer state, state for a
    parameter the optimizer lacks, non-elementwise state, or more parameter groups."""
    if not any(k == GROUPS or k.startswith(GROUPS + ".") for k in saved):
        raise KeyError(f"hsdp.load: the checkpoint at {path} holds no optimizer state (saved "
                       f"without an optimizer?); load it without one")
    _check_group_keys(path, saved, ours["param_groups"])
    state: dict[str, dict[str, Any]] = {}
    for key, md in saved.items():
        if not key.startswith(STATE):
            continue
        name, k = key[len(STATE):].rsplit(".", 1)
        if name not in params:
            _no_extra(path, [key])
        live = ours["state"].get(name, {}).get(k)
        state.setdefault(name, {})[k] = _target(path, key, md, params[name], live)
    return {"state": state, "param_groups": ours["param_groups"]}


def _check_group_keys(path: str, saved: dict[str, Any], ours: list[dict[str, Any]]) -> None:
    """DCP flattens the groups to ``optim.param_groups.<i>.<key>`` (the values are bytes,
    which ``check_groups`` compares once read): their number and each one's keys must be
    this optimizer's, or DCP would fail midway on a key it lacks and drop the ones this
    optimizer lacks (another optimizer class, or other options)."""
    keys: dict[int, set[str]] = {}
    for k in saved:
        if k.startswith(GROUPS + "."):
            i, key = k[len(GROUPS) + 1:].split(".", 1)
            keys.setdefault(int(i), set()).add(key)
    if not keys:
        return
    if len(keys) != len(ours):
        raise ValueError(f"hsdp.load: the checkpoint at {path} has {len(keys)} optimizer "
                         f"parameter group(s), this optimizer {len(ours)}; nothing was loaded")
    for i, pg in enumerate(ours):
        theirs, mine = keys[i] - {"param_names"}, set(pg) - {"param_names"}
        if theirs != mine:
            raise ValueError(
                f"hsdp.load: optimizer parameter group {i} in the checkpoint at {path} has "
                f"hyperparameters {sorted(theirs - mine)} this optimizer's lacks and lacks "
                f"{sorted(mine - theirs)} (saved with another optimizer class or other "
                f"options?); nothing was loaded")


def _target(path: str, key: str, md: Any, p: nn.Parameter, live: Any) -> Any:
    """What DCP reads ``key`` (state of parameter ``p``) into."""
    if isinstance(md, BytesStorageMetadata):
        return live if not torch.is_tensor(live) else None
    size, dtype = tuple(md.size), md.properties.dtype
    if torch.is_tensor(live) and tuple(live.shape) == size and live.dtype == dtype:
        return live
    if not size:
        return torch.empty((), dtype=dtype)
    if size != tuple(p.shape):
        raise ValueError(f"hsdp.load: {key} in the checkpoint at {path} has shape {size}, its "
                         f"parameter {tuple(p.shape)}: hsdp loads elementwise optimizer state")
    managed = owner(p)
    if managed is None:
        return torch.empty(size, dtype=dtype, device=p.device)
    group, idx = managed
    local = torch.empty_like(p._local_tensor, dtype=dtype)
    return group.params[idx].checkpoint_view(local)


def check_groups(where: str, saved: list[dict[str, Any]], ours: list[list[str]],
                 hyper: list[set[str]], state: dict[str, Any]) -> None:
    """The saved parameter groups (each ``params`` a list of names) are this optimizer's
    ``ours``, in the same order, with no hyperparameter its groups lack (``hyper``: their
    keys; another optimizer class has others), and every parameter with saved ``state`` is
    in them."""
    if len(saved) != len(ours):
        raise ValueError(f"{where} has {len(saved)} optimizer parameter group(s), this "
                         f"optimizer {len(ours)}; nothing was loaded")
    for i, (pg, names, mine) in enumerate(zip(saved, ours, hyper)):
        foreign = sorted(set(pg) - {"params", "param_names"} - mine)
        if foreign:
            raise ValueError(f"{where}: optimizer parameter group {i} has hyperparameters "
                             f"{foreign} that this optimizer's lack (saved with another "
                             f"optimizer class?); nothing was loaded")
        if list(pg["params"]) != names:
            odd = next((a, b) for a, b in zip(list(pg["params"]) + [None], names + [None])
                       if a != b)
            raise ValueError(f"{where}: optimizer parameter group {i} differs from this "
                             f"optimizer's ({odd[0]} where it has {odd[1]}); nothing was "
                             f"loaded")
    known = {n for names in ours for n in names}
    stray = sorted(set(state) - known)
    if stray:
        raise KeyError(f"{where} has optimizer state for {stray[0]}, which this optimizer "
                       f"lacks; nothing was loaded")
