"""The outer-axis interface: ``OuterMode``, one implementation per way of handling the
outer axis other than the exact reduction of every step's gradients (the default, and
what every hook here does when left alone).

A mode is the object the user passes (``fully_shard(outer_reduce=hsdp.OuterReduce(...))``,
``fully_shard(outer_gather=hsdp.OuterGather(...))``, ``init_mesh(outer_sync=
hsdp.DiLoCo(...))``): its settings and its hooks in one file (``sharding/outer_reduce.py``,
``sharding/outer_gather.py``, ``runtime/diloco.py``), registered once in
``runtime/outer_modes.py``, which maps each argument to its modes and parses their short
forms. The core calls the hooks and never asks which mode it holds:

- ``check_mesh`` (``init_mesh``) and ``check_shard`` (``fully_shard``): refusals, raised on
  every rank before anything is built;
- ``attach``: the mode's state on each parameter group (a residual, an anchor);
- ``reduces_every_step``: whether the backward reduces gradients over outer at all;
- ``schedule``: the model's ``OuterSchedule`` (its optimizer-step hooks, the op kinds it
  issues and their replay after an abandoned step), or None;
- ``capture_refusal`` / ``hook_refusal``: what CUDA-graph capture and
  ``set_all_reduce_hook`` cannot serve;
- ``reduce_op`` / ``gather_op``: the op kind (``streams/op_table.py``) of the outer
  reduction / gather it issues in place of the exact one;
- its state in checkpoints, one entry (``state_key``) of the optimizer's state dict, each
  group's values under "<unit>/<group>@<its keys>" (``checkpoint/extra_state.py`` walks
  the groups and keys them): ``state_dict`` and ``load_state_dict`` (an empty dict: none
  saved, start afresh), ``to_read`` / ``from_read`` (what ``hsdp.load`` reads of a
  checkpoint of any mesh, and what it makes of it), ``restore_after_model_load``,
  ``full_state_refusal``; and what a recovering replica group receives with fault
  tolerance (``replica_state`` / ``recover``, ``checkpoint/replica_state.py``).

An ``outer_sync`` mode reaches ``fully_shard`` on the mesh ``init_mesh`` returned for it
(``carrying`` / ``outer_sync_of``): one mesh object per schedule, no process-wide table.

The hooks take objects of higher layers (groups, units, the runtime context); they are
typed ``Any`` here, which sits below them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Entries = dict[str, torch.Tensor]  # one group's state-dict entries, by its own keys


class OuterSchedule:
    """A model's outer schedule when the outer axis does not follow every backward
    (``OuterMode.schedule``): hooks run by the optimizer-step wrapper, the op kinds it
    issues (``ops``: ``streams/op_table.py``) and their replay."""

    ops: ClassVar[tuple] = ()
    groups: Sequence[Any] = ()  # the groups it synchronizes

    def check_optimizer(self, optimizer: Any) -> None:
        """Raise before the step if ``optimizer`` cannot drive this schedule."""

    def before_step(self) -> None:
        """On compute, before the optimizer changes the parameters."""

    def after_step(self, ctx: Any) -> None:
        """After the optimizer step (``ctx``: the model's ``RuntimeContext``)."""

    def replay(self, kind: Any, group: Any, stream: Any, coll: Any, after: Any,
               keep_alive: list) -> Any:
        """Issue op ``kind`` (one of ``ops``) that another rank issued in an abandoned
        step, on scratch; returns its event."""
        raise NotImplementedError(f"{type(self).__name__} issues no {kind}")


class OuterMode:
    """One way of handling the outer axis; ``argument``: the one that selects it
    ("outer_reduce", "outer_gather" or "outer_sync"). Subclasses are frozen dataclasses of
    their settings; ``parse`` reads their short form (None: not this mode's)."""

    argument: ClassVar[str] = ""
    forms: ClassVar[str] = ""  # its short forms, for error messages
    reduces_every_step: ClassVar[bool] = True  # False: no outer reduction in the backward
    sync_quorum: ClassVar[bool] = False  # with fault tolerance: one torchft quorum per sync
    state_key: ClassVar[str] = ""  # its entry of optimizer state dicts ("": no state)
    state_name: ClassVar[str] = ""  # what that state is, in messages ("DiLoCo state")
    # what a load does with that state across modes (checkpoint/mode_switch.py's note):
    # saved but this mode absent from the model; in the model but none saved
    dropped_note: ClassVar[str] = ""
    fresh_note: ClassVar[str] = ""

    @classmethod
    def parse(cls, text: str) -> OuterMode | None:
        """This mode from its short form; None if ``text`` is another mode's."""
        return None

    def check_mesh(self, fault_tolerance: Any) -> None:
        """``init_mesh``'s refusals of this mode (``outer_sync`` modes)."""

    def check_shard(self, strategy: Any, comms: Any, device: Any, params: list,
                    names: list[str]) -> None:
        """``fully_shard``'s refusals of this mode for a unit of ``params``."""

    def attach(self, group: Any) -> None:
        """Give a ``ParamGroup`` this mode's state (after its layout, before its views)."""

    def schedule(self, units: Any) -> OuterSchedule | None:
        """The model's outer schedule (None: the backward's reductions are all)."""
        return None

    def capture_refusal(self, group: Any) -> tuple[str, str] | None:
        """(what a CUDA-graph capture cannot record of ``group``, what to do instead), or
        None."""
        return None

    def before_capture(self, group: Any) -> None:
        """A CUDA-graph capture of ``group``'s model begins (host only, after
        ``capture_refusal`` passed): move state a replay must find at fixed addresses
        into fixed buffers."""

    def hook_refusal(self, group: Any) -> str | None:
        """Why ``set_all_reduce_hook`` cannot serve ``group`` in this mode, or None."""
        return None

    def reduce_op(self, shard_outer: bool) -> Any | None:
        """The ``OpKind`` of the outer gradient reduction it issues for a group (hfsdp's
        when ``shard_outer``) in place of the exact one (None: the exact one)."""
        return None

    def gather_op(self) -> Any | None:
        """The ``OpKind`` of hfsdp's outer all-gather it issues (None: the exact one)."""
        return None

    def state_dict(self, group: Any, opt_state: Mapping | None) -> Entries:
        """``group``'s checkpoint entries (copies; the streams drained), by keys of the
        mode's choosing (unique to this rank, or shared by ranks that hold the same
        values); ``opt_state``: the optimizer's state by parameter (with the state a first
        step would create where it has none yet)."""
        return {}

    def load_state_dict(self, group: Any, state: Entries, opt_state: Mapping | None) -> None:
        """Set ``group``'s state from ``state`` (``state_dict``'s form, checked to hold
        every key it gives; empty: none saved, start afresh), after the optimizer's own
        load."""

    def to_read(self, group: Any, ours: Entries, saved: dict[str, tuple[int, ...]]
                ) -> Entries:
        """What ``hsdp.load`` reads into, of a checkpoint that holds ``saved`` (this
        group's keys of this mode, of any mesh, with their shapes); ``ours``: this
        rank's ``state_dict``. By default the keys it holds with the same shape."""
        return {k: v for k, v in ours.items() if saved.get(k) == tuple(v.shape)}

    def from_read(self, group: Any, read: Entries) -> Entries:
        """``group``'s state (``load_state_dict``'s form) from ``to_read``'s entries once
        read (another mesh's converted)."""
        return read

    def restore_after_model_load(self, group: Any, state: Entries,
                                 opt_state: Mapping | None) -> None:
        """Put back what a model load of the same checkpoint, after this state's load,
        wrote over (torchtitan loads the model after the optimizer)."""

    def full_state_refusal(self) -> str | None:
        """Why a full optimizer state dict (the same on every rank) cannot hold this
        mode's state (None: its entries go in as they are)."""
        return f"{self.state_name} (each rank's own)"

    def replica_state(self, group: Any) -> Any:
        """What a recovering replica group receives of ``group``'s state (fault
        tolerance; views: asked for when nothing of it is pending), or None."""
        return None

    def recover(self, group: Any, state: Any) -> None:
        """Take a live replica group's ``replica_state`` (received)."""


def place(comms: Any, outer: bool = True) -> str:
    """This rank's place on its mesh, for state-dict keys: "OxIxT:o-i-t" (sizes, then
    coordinates); without ``outer``, "OxIxT:i-t" (the same on every outer replica)."""
    t = 0 if comms.host_tp is None else dist.get_rank(comms.host_tp)
    coords = (comms.outer_rank, comms.inner_rank, t) if outer else (comms.inner_rank, t)
    return (f"{comms.outer_size}x{comms.inner_size}x{comms.tp_size}:"
            f"{'-'.join(map(str, coords))}")


_OUTER_SYNC = "_hsdp_outer_sync"  # the DeviceMesh attribute holding its outer schedule


def outer_sync_of(mesh: DeviceMesh) -> OuterMode | None:
    """The ``outer_sync`` mode ``mesh`` was made with (``init_mesh``), None: every step."""
    return getattr(mesh, _OUTER_SYNC, None)


def carrying(mesh: DeviceMesh, mode: OuterMode | None) -> DeviceMesh:
    """``mesh`` if it carries ``mode``, else an equal mesh (same ranks, same groups: a
    shallow copy) that does."""
    if outer_sync_of(mesh) == mode:
        return mesh
    out = copy.copy(mesh)
    setattr(out, _OUTER_SYNC, mode)
    return out
