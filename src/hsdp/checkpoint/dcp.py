"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

State dicts hold hsdp's parameters and optimizer state as DTensors over this rank's flat
pieces, each carrying DCP chunk hooks that describe the piece as row-major boxes of the
global tensor (``pieces.py``). Why that representation: every rank writes only what it owns
(no all-gather, no full-size tensor), and DCP's default planners match saved and wanted
boxes by global offsets, so a checkpoint loads on another mesh, strategy or world size.

``save`` writes into a hidden sibling directory and publishes it by atomically switching
the ``path`` symlink, so a save that dies midway leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

import hsdp.checkpoint.torch_state_dict  # noqa: F401  (torch's full-state-dict loads on Pieces)
from hsdp.checkpoint import dirs, integrity
from hsdp.checkpoint.full_state import clean_key, clean_keys, model_keys, quiesce
from hsdp.checkpoint.lazy_state import initial_state, supported
from hsdp.checkpoint.outer_residual import KEY, in_checkpoint, load_residuals, residual_state
from hsdp.checkpoint.outer_sync_state import KEY as SYNC_KEY
from hsdp.checkpoint.outer_sync_state import load_outer_sync, outer_sync_state
from hsdp.checkpoint.sync import CheckpointError, Meeting
from hsdp.sharding.chunks import attach_chunks
from hsdp.sharding.group import owner
from hsdp.sharding.pieces import Piece, adopt_state
from hsdp.sharding.write_guard import before_write
from hsdp.streams.teardown import before_destroy
from hsdp.topology.communicators import host_group

ModelState = dict[str, Any]
OptimState = dict[str, Any]


# ---------------------------------------------------------------- module hooks

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
            state_dict[key] = group.checkpoint_view(idx)


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
            group.local(idx).copy_(src)  # bumps main's version: hfsdp re-gathers
            state_dict[key] = p  # torch's own copy is then a no-op


def _piece_of(key: str, p: nn.Parameter, value: Any) -> torch.Tensor:
    group, idx = owner(p)
    start, length = group.shard_starts[idx], group.local(idx).numel()
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
    return group.piece_of(idx, value)


# ---------------------------------------------------------------- state dicts

def _param_names(model: nn.Module) -> dict[int, str]:
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
    names = _param_names(model)
    state: dict[str, dict[str, Any]] = {}
    held: dict[torch.Tensor, dict[str, Any]] = {}  # by parameter, for DiLoCo's replicas
    for pg in optimizer.param_groups:
        for p in pg["params"]:
            name = _name_of(names, p)
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
               "params": [_name_of(names, p) for p in pg["params"]]}
              for pg in optimizer.param_groups]
    optim_sd = {"state": state, "param_groups": groups}
    residuals = residual_state(model)  # compressed outer reduction: training state too
    if residuals:
        optim_sd[KEY] = residuals
    outer_sync = outer_sync_state(model, held)  # DiLoCo: anchors, replica-local state
    if outer_sync:
        optim_sd[SYNC_KEY] = outer_sync
    return optim_sd


def _name_of(names: dict[int, str], p: torch.Tensor) -> str:
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
    return group.checkpoint_view(idx, value._local_tensor)


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   model_state_dict: ModelState,
                   optim_state_dict: OptimState | None = None) -> None:
    """Load what ``torch.distributed.checkpoint.load`` read into ``get_state_dict``'s
    dicts: the model's values (already in place when loaded into those views) and the
    optimizer's state and hyperparameters."""
    quiesce(model, "set_state_dict")
    model.load_state_dict(model_keys(model, model_state_dict))
    if optimizer is None or not optim_state_dict:
        return
    names = _param_names(model)
    index: dict[str, int] = {}
    for p in (p for pg in optimizer.param_groups for p in pg["params"]):
        index.setdefault(_name_of(names, p), len(index))
    state = {index[name]: st for name, st in optim_state_dict["state"].items()}
    groups = [{**pg, "params": [index[n] for n in pg["params"]]}
              for pg in optim_state_dict["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    adopt_state(optimizer.state)
    load_residuals(model, optim_state_dict.get(KEY))
    load_outer_sync(model, optim_state_dict.get(SYNC_KEY), optimizer)


# ---------------------------------------------------------------- save / load

class SaveHandle:
    """An asynchronous ``save`` in flight. ``wait()`` (a collective: call it on every rank)
    returns once the checkpoint is written and published at its path, or raises a
    ``CheckpointError`` on every rank. ``hsdp.synchronize``, the next ``save``,
    ``destroy_process_group()`` and the interpreter's exit finish it too."""

    def __init__(self, meeting: Meeting, future: Future, publish: Callable[[], None]) -> None:
        self.path = meeting.path
        self._meeting = meeting
        self._published = threading.Event()
        self._error: BaseException | None = None

        def done(f: Future) -> None:  # on DCP's upload thread: publish without a wait()
            try:
                f.result()
                publish()
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self._error = e
            self._published.set()

        future.add_done_callback(done)
        self._waited = False

    def done(self) -> bool:
        return self._published.is_set()

    def wait(self) -> None:
        if self._waited:
            return
        self._waited = True
        _PENDING.remove(self)
        self._published.wait()
        failure = self._meeting.first_failure(host_group(), "published", self._error)
        if failure is not None:
            raise _save_failed(self.path, failure) from self._error


_PENDING: list[SaveHandle] = []


def finish_saves() -> None:
    """Wait for every asynchronous save in flight (a collective, like ``SaveHandle.wait``)."""
    while _PENDING:
        _PENDING[0].wait()


@atexit.register
def _finish_at_exit() -> None:
    """At the interpreter's exit, a save nobody waited for is still written and published
    (rank 0 publishes it when its data is complete); one that failed ends the process with
    status 1 and its error, never silently."""
    failed = []
    for handle in _PENDING:
        handle._published.wait()
        if handle._error is not None:
            failed.append(f"hsdp.save of {handle.path} failed: {handle._error!r}")
    if failed:
        sys.stderr.write("\n".join(failed) + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


before_destroy(finish_saves)


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer that records checksums of what each rank wrote (``integrity``) and
    whose asynchronous staging keeps hsdp's chunk hooks (DCP's own CPU copy would drop them
    and fall back to the DTensor placements)."""

    def __init__(self, path: str, meeting: Meeting) -> None:
        super().__init__(path)
        self._dir, self._meeting = path, meeting

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _to_cpu(state_dict)

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        integrity.record(self._dir, dist.get_rank(), [r.storage_data for r in future.wait()])
        self._meeting.arrive("written")
        return future


class _Reader(FileSystemReader):
    """DCP's file reader that checks each file's byte ranges (``integrity.verify``) before
    DCP reads them, and names the file in any error."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._dir = path

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            sums = integrity.load_sums(self._dir)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        required = os.path.isfile(os.path.join(self._dir, dirs.MARKER))  # hsdp wrote it
        per_file: dict[str, list] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append(item)
        for name, items in per_file.items():
            file = os.path.join(self._dir, name)
            try:
                integrity.verify(file, [self.storage_data[i.storage_index] for i in items],
                                 sums, required)
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                raise CheckpointError(f"{file}: {e}") from e
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


def _to_cpu(obj: Any) -> Any:
    """A CPU copy of a state dict whose DTensors keep hsdp's chunk hooks."""
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, DTensor):
        local = obj._local_tensor.detach().to("cpu", copy=True)
        _, start, length = obj._local_tensor._hsdp_piece
        attach_chunks(local, obj._spec, start, length)
        return DTensor(local, obj._spec, requires_grad=False)
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    return obj


def _commit(live: Any, read: Any) -> Any:
    """Copy the values ``dcp.load`` read into ``read`` (``_to_cpu(live)``) into ``live``'s
    tensors; the other values are ``read``'s."""
    if isinstance(live, dict):
        return {k: _commit(v, read[k]) for k, v in live.items()}
    if isinstance(live, list):
        return [_commit(v, r) for v, r in zip(live, read)]
    if isinstance(live, DTensor):
        live._local_tensor.copy_(read._local_tensor)
    elif isinstance(live, torch.Tensor):
        live.copy_(read)
    else:
        return read
    return live


def _check_root(model: nn.Module, what: str) -> None:
    """Refuse a unit inside a larger sharded model: its checkpoint would lack the rest."""
    unit = getattr(model, "_hsdp_unit", None)
    if unit is None or unit.enclosing is None:
        return
    root = unit
    while root.enclosing is not None:
        root = root.enclosing
    raise ValueError(f"{what}: {unit.label} is a unit inside the sharded model {root.label}; "
                     f"pass the root module (the one fully_shard was applied to last)")


def save(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None, *,
         async_save: bool = False) -> SaveHandle | None:
    """Save model (and optimizer) to ``path`` with DCP; every rank writes its own pieces.
    A collective. The data goes to a new hidden sibling directory first; ``path`` (a
    symlink hsdp made) is switched to it atomically once every rank has written, so an
    interrupted save leaves the previous checkpoint at ``path`` intact. hsdp replaces and
    removes only what it made (see ``checkpoint/dirs.py``): anything else at ``path`` raises
    ``FileExistsError`` on every rank before anything is written.

    ``async_save=True``: the state is copied to CPU, then written in the background while
    training goes on; returns a handle whose ``wait()`` (on every rank) blocks until the
    checkpoint is published. A later save first waits for the earlier one."""
    finish_saves()
    _check_root(model, "hsdp.save")
    path = os.path.abspath(os.fspath(path))
    group = host_group()
    meeting = Meeting("hsdp.save", path)
    staging = meeting.agree(group, "start", lambda: dirs.claim(path))
    quiesce(model, "save")
    state = {"model": clean_keys(model.state_dict()),
             "optim": {} if optimizer is None else optim_state_dict(model, optimizer,
                                                                   strict=False)}
    writer = CheckpointWriter(staging, meeting)

    def publish() -> None:
        if dist.get_rank() == 0:
            dirs.publish(path, staging)

    if async_save:  # DCP's upload thread gets a group of its own (see host_group)
        handle = SaveHandle(meeting, dcp.async_save(state, storage_writer=writer,
                                                    process_group=host_group("async save")),
                            publish)
        _PENDING.append(handle)
        return handle
    try:
        with meeting.at("written", arrive=False):  # the writer arrives once it has written
            dcp.save(state, storage_writer=writer, process_group=group)
    except CheckpointException as e:  # a BaseException: keep it catchable as an error
        raise _save_failed(path, _failures(e)) from e
    meeting.agree(group, "published", publish)
    return None


def _failures(error: CheckpointException) -> str:
    """Each failed rank's error (DCP's message only says which ranks failed)."""
    return "; ".join(f"rank {rank}: {exc}" for rank, (exc, _) in
                     sorted(error.failures.items())) or str(error)


def _save_failed(path: str, error: BaseException | str) -> CheckpointError:
    return CheckpointError(f"hsdp.save: writing {path} failed; the checkpoint previously at "
                           f"that path (if any) is unchanged. {error}")


def load(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written by ``save`` (on any mesh, strategy or world size) into
    ``model`` (and ``optimizer``). A collective, all or nothing: names and shapes are
    checked against the checkpoint, then everything is read into a CPU copy of this
    rank's pieces (the parameters' and optimizer state's: the memory they take, once more)
    and checked against the checksums ``save`` recorded; only then are the model and
    optimizer changed. A mismatch, a missing, truncated or corrupt file raises an error
    naming it on every rank (``CheckpointError`` for the files) and changes nothing."""
    _check_root(model, "hsdp.load")
    path = os.fspath(path)
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:
        raise FileNotFoundError(f"hsdp.load: {path} is not a checkpoint ({e})") from e
    meeting = Meeting("hsdp.load", path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    for key in (KEY, SYNC_KEY):  # another mesh's are none of this rank's (outer_residual.py)
        if key in optim_sd:
            optim_sd[key] = in_checkpoint(optim_sd[key], metadata.state_dict_metadata,
                                          f"optim.{key}.")
    state = {"model": model_sd, "optim": optim_sd}
    try:
        _check(path, state, metadata.state_dict_metadata)
        read = _to_cpu(state)
        with meeting.at("reading"):
            dcp.load(read, storage_reader=_Reader(path), process_group=host_group())
    except CheckpointException as e:  # a BaseException: keep it catchable as an error
        raise CheckpointError(f"hsdp.load: reading {path} failed; the model and optimizer "
                              f"are unchanged. {_failures(e)}") from e
    state = _commit(state, read)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(flattened DCP key, tensor) for every tensor in nested dicts."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, torch.Tensor):
        yield prefix, obj


def _check(path: str, state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Every tensor we would load exists in the checkpoint with the same global shape, and
    the checkpoint holds no model or optimizer tensor we lack."""
    ours = dict(_tensors(state, ""))
    for key, t in ours.items():
        md = saved.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"hsdp.load: {key} is not in the checkpoint at {path}")
        if tuple(md.size) != tuple(t.shape):
            raise ValueError(f"hsdp.load: {key} has shape {tuple(md.size)} in the checkpoint "
                             f"at {path}, {tuple(t.shape)} here")
    extra = sorted(k for k, md in saved.items()
                   if isinstance(md, TensorStorageMetadata) and k not in ours
                   and not k.startswith((f"optim.{KEY}.", f"optim.{SYNC_KEY}."))  # other ranks'
                   and (k.startswith("model.") or (k.startswith("optim.") and state["optim"])))
    if extra:
        raise KeyError(f"hsdp.load: the checkpoint at {path} has {extra[0]}, which this model "
                       f"(or optimizer) lacks" + (f" (and {len(extra) - 1} more)"
                                                  if len(extra) > 1 else ""))
