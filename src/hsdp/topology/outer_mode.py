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
  ``set_all_reduce_hook`` cannot serve.

An ``outer_sync`` mode reaches ``fully_shard`` on the mesh ``init_mesh`` returned for it
(``carrying`` / ``outer_sync_of``): one mesh object per schedule, no process-wide table.

The hooks take objects of higher layers (groups, units, the runtime context); they are
typed ``Any`` here, which sits below them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar

from torch.distributed.device_mesh import DeviceMesh


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

    def hook_refusal(self, group: Any) -> str | None:
        """Why ``set_all_reduce_hook`` cannot serve ``group`` in this mode, or None."""
        return None


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
