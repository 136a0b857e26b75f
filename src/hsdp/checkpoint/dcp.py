"""Sharded checkpoints with torch.distributed.checkpoint (DCP): ``save`` and ``load`` of the
state dicts of ``state_dicts.py``.

``save`` writes into a hidden sibling directory and publishes it by atomically switching
the ``path`` symlink, so a save that dies midway leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.tensor import DTensor

from hsdp.checkpoint import integrity, mode_switch
from hsdp.checkpoint.extra_state import Loaded, apply, from_read, to_read
from hsdp.checkpoint.full_state import clean_keys, model_keys, quiesce
from hsdp.checkpoint.load_targets import check_model, optim_targets
from hsdp.checkpoint.publication import Claim
from hsdp.checkpoint.state_dicts import name_of, optim_state_dict, optimizer_input, param_names
from hsdp.checkpoint.sync import CheckpointError, Meeting
from hsdp.sharding.chunks import attach_chunks
from hsdp.sharding.pieces import adopt_state
from hsdp.streams.teardown import before_destroy
from hsdp.topology.communicators import host_group


class SaveHandle:
    """An asynchronous ``save`` in flight. ``wait()`` (a collective: call it on every rank)
    returns once the checkpoint is written and published at its path, or raises a
    ``CheckpointError`` on every rank. ``hsdp.synchronize``, the next ``save``,
    ``destroy_process_group()`` and the interpreter's exit finish it too."""

    def __init__(self, meeting: Meeting, future: Future, claim: Claim) -> None:
        self.path = meeting.path
        self._meeting, self._claim = meeting, claim
        self._published = threading.Event()
        self._error: BaseException | None = None

        def done(f: Future) -> None:  # on DCP's upload thread: publish without a wait()
            try:
                f.result()
                claim.publish()
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                claim.release()
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
            raise self._claim.failed(failure) from self._error


# Process-wide: asynchronous saves outlive their call; finish_saves waits for all before exit.
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


before_destroy(finish_saves)  # destroy_process_group() finishes a save in flight first


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer that binds the checkpoint to one save (``integrity``: its id in
    DCP's metadata and in the checksums of what each rank wrote, and a seal of the metadata)
    and whose asynchronous staging keeps hsdp's chunk hooks (DCP's own CPU copy would drop
    them and fall back to the DTensor placements)."""

    def __init__(self, path: str, meeting: Meeting, save_id: str) -> None:
        super().__init__(path)
        self._dir, self._meeting, self._save_id = path, meeting, save_id

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _to_cpu(state_dict)

    def storage_meta(self) -> StorageMeta:
        meta = super().storage_meta() or StorageMeta()
        meta.save_id = self._save_id
        return meta

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        integrity.record(self._dir, dist.get_rank(), [r.storage_data for r in future.wait()],
                         self._save_id)
        self._meeting.arrive("written")
        return future

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        super().finish(metadata, results)
        integrity.seal(self._dir, self._save_id, len(results))


class _Reader(FileSystemReader):
    """DCP's file reader over a checkpoint ``integrity.open_checkpoint`` has checked: DCP
    gets its metadata from there (not unpickled again), and each file's byte ranges are
    checked (``integrity.verify``) before DCP reads them; any error names the file."""

    def __init__(self, path: str, opened: integrity.Opened) -> None:
        super().__init__(path)
        self._dir, self._opened = path, opened

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = self._opened.metadata
        metadata.storage_meta.load_id = getattr(self, "load_id", None)  # as DCP's reader
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        per_file: dict[str, list] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append(item)
        for name, items in per_file.items():
            file = os.path.join(self._dir, name)
            try:
                integrity.verify(file, [self.storage_data[i.storage_index] for i in items],
                                 self._opened.sums, self._opened.required)
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
    ``FileExistsError`` on every rank before anything is written. One save at a time per
    path, across jobs (``checkpoint/save_lock.py``): while another job saves to ``path``,
    this one raises ``CheckpointBusyError`` on every rank and writes nothing.

    ``async_save=True``: the state is copied to CPU, then written in the background while
    training goes on; returns a handle whose ``wait()`` (on every rank) blocks until the
    checkpoint is published. A later save first waits for the earlier one."""
    finish_saves()
    _check_root(model, "hsdp.save")
    path = os.path.abspath(os.fspath(path))
    group = host_group()
    meeting = Meeting("hsdp.save", path)
    claim = Claim(path)
    try:
        claim.begin(meeting, group)
        quiesce(model, "save")
        state = {"model": clean_keys(model.state_dict()),
                 "optim": {} if optimizer is None else optim_state_dict(model, optimizer,
                                                                       strict=False)}
        writer = CheckpointWriter(claim.staging, meeting, claim.save_id)
        if async_save:  # DCP's upload thread gets a group of its own (see host_group)
            handle = SaveHandle(meeting, dcp.async_save(
                state, storage_writer=writer, process_group=host_group("async save")), claim)
            _PENDING.append(handle)
            return handle
        try:
            with meeting.at("written", arrive=False):  # the writer arrives once written
                dcp.save(state, storage_writer=writer, process_group=group)
        except CheckpointException as e:  # a BaseException: keep it catchable as an error
            raise claim.failed(_failures(e)) from e
        meeting.agree(group, "published", claim.publish)
    except BaseException:
        claim.release()  # rank 0: the path's lock, unless publish gave it back
        raise
    return None


def _failures(error: CheckpointException) -> str:
    """Each failed rank's error (DCP's message only says which ranks failed)."""
    return "; ".join(f"rank {rank}: {exc}" for rank, (exc, _) in
                     sorted(error.failures.items())) or str(error)


def load(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written by ``save`` (on any mesh, strategy or world size) into
    ``model`` (and ``optimizer``). A collective, all or nothing: the model's names, shapes
    and dtypes and the optimizer state's layout are checked against the checkpoint on every
    rank, then everything is read into a CPU copy of this rank's pieces (the parameters'
    and optimizer state's: the memory they take, once more) and checked against the
    checksums ``save`` recorded, and the optimizer's parameter groups against the saved
    ones; only then are the model and optimizer changed. The optimizer gets exactly the
    saved state (``load_targets``). A mismatch, a missing, truncated or corrupt file raises
    an error naming it on every rank (``CheckpointError`` for the files) and changes
    nothing."""
    _check_root(model, "hsdp.load")
    quiesce(model, "load")
    path = os.fspath(path)
    group = host_group()
    meeting = Meeting("hsdp.load", path)
    opened, state = meeting.verdict(group, "checked",
                                    lambda: _load_targets(path, model, optimizer))
    read = _to_cpu(state)
    try:
        with meeting.at("reading"):
            dcp.load(read, storage_reader=_Reader(path, opened), process_group=group,
                     planner=mode_switch.Quiet())
    except CheckpointException as e:  # a BaseException: keep it catchable as an error
        raise CheckpointError(f"hsdp.load: reading {path} failed; the model and optimizer "
                              f"are unchanged. {_failures(e)}") from e
    where = f"hsdp.load: the checkpoint at {path}"
    if optimizer is not None:  # the groups, read from the checkpoint, are checked too
        loaded = meeting.verdict(group, "groups",
                                 lambda: _checked_read(model, optimizer, read["optim"], where))
    state = _commit(state, read)
    model.load_state_dict(model_keys(model, state["model"]))
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_input(model, optimizer, state["optim"], where))
        adopt_state(optimizer.state)
        apply(model, loaded, optimizer.state)


def _checked_read(model: nn.Module, optimizer: torch.optim.Optimizer, read: dict[str, Any],
                  where: str) -> Loaded:
    """The outer modes' state that ``read`` (the optimizer's part, read) gives (this
    rank's, or converted from another layout's), once its parameter groups are checked
    against the optimizer's: before anything is written."""
    optimizer_input(model, optimizer, read, where)
    return from_read(model, read)


def _load_targets(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None
                  ) -> tuple[integrity.Opened, dict[str, Any]]:
    """The checked checkpoint and what ``load`` reads into, once its metadata says it
    fits."""
    try:
        opened = integrity.open_checkpoint(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"hsdp.load: {path} is not a checkpoint ({e})") from e
    except Exception as e:
        raise CheckpointError(f"hsdp.load: {path}: {e}; the model and optimizer are "
                              f"unchanged") from e
    saved = opened.metadata.state_dict_metadata
    model_sd = clean_keys(model.state_dict())
    check_model(path, model_sd, saved)
    if optimizer is None:
        return opened, {"model": model_sd, "optim": {}}
    names = param_names(model)
    params = {name_of(names, p): p for pg in optimizer.param_groups for p in pg["params"]}
    ours = optim_state_dict(model, optimizer, strict=False)
    optim = optim_targets(path, ours, params, saved)
    # the outer modes' state: this rank's, or what converts another mesh's (their to_read)
    optim.update(to_read(model, ours, saved, "optim."))
    mode_switch.note_read(f"hsdp.load of {path}", saved, ours, optim)
    return opened, {"model": model_sd, "optim": optim}
