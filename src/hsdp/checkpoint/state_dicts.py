"""State dicts of hsdp models and their optimizers for torch.distributed.checkpoint (DCP).

They hold hsdp's parameters and optimizer state as DTensors over this rank's flat
pieces, each carrying DCP chunk hooks that describe the piece as row-major boxes of the
global tensor (``sharding/pieces.py``). Why that representation: every rank writes only
what it owns (no all-gather, no full-size tensor), and DCP's default planners match saved
and wanted boxes by global offsets, so a checkpoint loads on another mesh, strategy or
world size. ``dcp.py`` saves and loads them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hsdp.checkpoint.extra_state import apply, extra_state, prepare, split
from hsdp.checkpoint.full_state import clean_key, clean_keys, model_keys, quiesce
from hsdp.checkpoint.lazy_state import initial_state, supported
from hsdp.checkpoint.load_targets import check_groups
from hsdp.sharding.group import owner
from hsdp.sharding.pieces import Piece, adopt_state
from hsdp.sharding.write_guard import before_write

ModelState = dict[str, Any]


OptimState = dict[str, Any]


def _managed_slots(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Parameter]]:
    """(state-dict key, sharded parameter) for every hsdp parameter slot under ``module``,
    aliases (tied weights) included."""
    for mname, m in module.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is not None and owner(p) is not None:
                yield f"{prefix}{mname}.{pname}" if mname else prefix + pname, p


def state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, _meta: Any) -> None:
    """``model.state_dict()``: hsdp's parameters as checkpoint DTensors (this rank's piece
    with DCP chunk metadata), not the bare local pieces."""
    groups = module._hsdp_unit.groups
    for key, p in _managed_slots(module, prefix):
        group, idx = owner(p)
        if group in groups and key in state_dict and state_dict[key] is not p:
            before_write([p])  # DCP may load into the view
            state_dict[key] = group.params[idx].checkpoint_view()


def load_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """``model.load_state_dict()``: accept hsdp checkpoint DTensors of the same pieces (as
    ``state_dict()`` gives them) or full tensors (a plain model's state dict, the same on
    every rank); anything else raises before any parameter is written."""
    todo = [(key, p, state_dict[key]) for key, p in _managed_slots(module, prefix)
            if key in state_dict and state_dict[key] is not p]
    sources = [_piece_of(key, p, value) for key, p, value in todo]
    before_write([p for _, p, _ in todo])
    with torch.no_grad():
        for (key, p, _), src in zip(todo, sources):
            group, idx = owner(p)
            group.params[idx].local.copy_(src)  # bumps main's version: hfsdp re-gathers
            state_dict[key] = p  # torch's own copy is then a no-op


def _piece_of(key: str, p: nn.Parameter, value: Any) -> torch.Tensor:
    group, idx = owner(p)
    q = group.params[idx]
    start, length = q.start, q.length
    if isinstance(value, DTensor):
        piece = getattr(value._local_tensor, "_hsdp_piece", None)
        if piece is None and isinstance(value, Piece):  # e.g. a clone: where it lies
            piece = (value.shape, *value._hsdp_range)
        if (piece != (p.shape, start, length) or value.device_mesh != p.device_mesh
                or value.placements != p.placements):
            raise ValueError(
                f"hsdp: {key} is a DTensor sharded differently from this model (another "
                f"mesh, strategy or library); load it with hsdp.load or hsdp.set_state_dict "
                f"after torch.distributed.checkpoint.load, which reshard")
        return value._local_tensor.reshape(-1)[:length]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"hsdp: {key} must be a tensor, got {type(value).__name__}")
    if value.shape != p.shape:
        raise ValueError(f"hsdp: {key} has shape {tuple(value.shape)}, the model's is "
                         f"{tuple(p.shape)}")
    return q.piece_of(value)


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name (the one ``named_parameters`` yields; clean, see
    ``state.clean_key``)."""
    return {id(p): clean_key(name) for name, p in reversed(list(model.named_parameters()))}


def get_state_dict(model: nn.Module,
                   optimizer: torch.optim.Optimizer | None = None) -> tuple[ModelState,
                                                                            OptimState]:
    """``(model_state_dict, optim_state_dict)`` for ``torch.distributed.checkpoint.save`` /
    ``load``: original names (``_orig_mod.`` dropped, as torch's ``get_model_state_dict``
    does) and global shapes; each rank's values are views of what it
    owns (nothing is gathered or copied). The optimizer state is keyed by parameter name
    and sharded like the parameters. A parameter without optimizer state yet gets the state
    its first step would create (``lazy_state``: new tensors, nothing is stored in the
    optimizer, which is not stepped), so that ``dcp.load`` has tensors to load into; for an
    optimizer whose initial state hsdp cannot build that way it raises ``ValueError``."""
    quiesce(model, "get_state_dict")
    model_sd = clean_keys(model.state_dict())
    if optimizer is None:
        return model_sd, {}
    return model_sd, optim_state_dict(model, optimizer, strict=True)


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                     strict: bool) -> OptimState:
    """The optimizer's part of ``get_state_dict``. A trainable parameter without state gets
    ``lazy_state.initial_state`` (never stored in the optimizer); where that cannot be built,
    ``strict`` raises ``ValueError`` and otherwise the parameter is left without state in
    the dict (``hsdp.load`` restores it so)."""
    names = param_names(model)
    state: dict[str, dict[str, Any]] = {}
    held: dict[torch.Tensor, dict[str, Any]] = {}  # by parameter, for the outer modes
    for pg in optimizer.param_groups:
        for p in pg["params"]:
            name = name_of(names, p)
            st = optimizer.state.get(p)  # .get: the state is a defaultdict
            if not st and p.requires_grad:
                st = initial_state(optimizer, pg, p)
                if st is None and strict:
                    raise ValueError(
                        f"hsdp.get_state_dict: {name} has no optimizer state yet, and hsdp "
                        f"cannot build {type(optimizer).__name__}'s initial state without "
                        f"stepping the optimizer (it can for {supported()}; SGD without "
                        f"dampening). Take an optimizer step first, or use hsdp.save / "
                        f"hsdp.load, which need no such state.")
            if st:
                state[name] = {k: _state_view(p, name, k, v) for k, v in st.items()}
                held[p] = st
    groups = [{**{k: v for k, v in pg.items() if k != "params"},
               "params": [name_of(names, p) for p in pg["params"]]}
              for pg in optimizer.param_groups]
    # the outer modes' state (extra_state.py): training state too
    return {"state": state, "param_groups": groups, **extra_state(model, held)}


def name_of(names: dict[int, str], p: torch.Tensor) -> str:
    if id(p) not in names:
        raise ValueError("hsdp: the optimizer holds a tensor that is not a parameter of the "
                         "model (was it built before fully_shard?)")
    return names[id(p)]


def _state_view(p: torch.Tensor, name: str, key: str, value: Any) -> Any:
    """Optimizer state laid out like its parameter's piece -> a checkpoint DTensor."""
    managed = owner(p)
    if managed is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    group, idx = managed
    if not (isinstance(value, DTensor) and value._spec == p._spec
            and value._local_tensor.numel() == p._local_tensor.numel()):
        raise ValueError(
            f"hsdp: optimizer state {name}.{key} is not laid out like its parameter (shape "
            f"{tuple(value.shape)}); hsdp checkpoints support elementwise optimizer state")
    return group.params[idx].checkpoint_view(value._local_tensor)


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   model_state_dict: ModelState,
                   optim_state_dict: OptimState | None = None) -> None:
    """Load what ``torch.distributed.checkpoint.load`` read into ``get_state_dict``'s
    dicts: the model's values (already in place when loaded into those views), the
    optimizer's state and hyperparameters, and the outer modes' state
    (``extra_state``). The optimizer's parameter groups and hsdp's state are checked
    first: a mismatch raises ``ValueError`` before the model is written."""
    quiesce(model, "set_state_dict")
    groups = None
    if optimizer is not None and optim_state_dict:
        where = "hsdp.set_state_dict"
        groups = optimizer_input(model, optimizer, optim_state_dict, where)
        loaded = prepare(model, split(optim_state_dict)[1], optimizer.state, where)
    model.load_state_dict(model_keys(model, model_state_dict))
    if groups is not None:
        optimizer.load_state_dict(groups)
        adopt_state(optimizer.state)
        apply(model, loaded, optimizer.state)


def optimizer_input(model: nn.Module, optimizer: torch.optim.Optimizer,
                     optim_state_dict: OptimState, where: str) -> dict[str, Any]:
    """``optim_state_dict`` (keyed by names) as ``optimizer.load_state_dict`` takes it, once
    its groups are checked against the optimizer's (``load_targets.check_groups``)."""
    names = param_names(model)
    ours = [[name_of(names, p) for p in pg["params"]] for pg in optimizer.param_groups]
    hyper = [set(pg) for pg in optimizer.param_groups]
    check_groups(where, optim_state_dict["param_groups"], ours, hyper,
                 optim_state_dict["state"])
    index: dict[str, int] = {}
    for name in (n for group in ours for n in group):
        index.setdefault(name, len(index))
    state = {index[name]: st for name, st in optim_state_dict["state"].items()}
    groups = [{**pg, "params": [index[n] for n in pg["params"]]}
              for pg in optim_state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}
