"""``Runtime``: what the root unit of a model shares with every unit below it (the named
streams, the recorded execution order, microbatch state); its jobs live in ``schedule.py``
(forward, backward, reduction), ``gather.py``, ``recovery.py`` and ``optim.py``."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import hsdp.streams.teardown  # noqa: F401  (destroy_process_group waits for hsdp's streams)
from hsdp.runtime.gather import Gathering
from hsdp.runtime.hooks import units_below
from hsdp.runtime.optim import RUNTIMES, OptimizerSteps
from hsdp.runtime.outer_sync import outer_sync_of
from hsdp.runtime.recovery import Recovery
from hsdp.runtime.schedule import Schedule
from hsdp.runtime.state import StepState
from hsdp.runtime.step_agreement import StepLog
from hsdp.sharding.group import ParamGroup
from hsdp.streams.contract import Event, SideStream
from hsdp.streams.op_table import OpKind, op_table
from hsdp.streams.stream_set import Streams
from hsdp.topology.build_agreement import agree_on_group
from hsdp.topology.communicators import CommGroups, comm_groups

if TYPE_CHECKING:
    from hsdp.runtime.unit import Unit


def _agree_on_model(root: Unit, units: list[Unit], comms: CommGroups) -> None:
    """Raise on every rank, naming the first difference, unless every rank sharded the
    same model the same way: otherwise the collectives would not match (a hang, an abort,
    or silently different "replicated" parameters)."""
    path = {id(m): n for n, m in root.module.named_modules()}
    lines = [f"{len(units)} units"] + [
        f"unit {path.get(id(u.module)) or '<root>'}: {line}"
        for u in units for line in u.description]
    agree_on_group("model", lines, comms.control, comms.timeout,
                   "Every rank must build the same model and call fully_shard on the same "
                   "modules with the same options.")



class Runtime(Schedule, Gathering, Recovery, OptimizerSteps):
    def __init__(self, root: Unit) -> None:
        self.root = root
        self.units = list(units_below(root.module))
        for u in self.units:
            if u.runtime is not None:
                raise RuntimeError(
                    f"hsdp: unit {u.label} already ran under another root; run the model "
                    f"through its outermost fully_shard module")
            if u.overlap_outer != root.overlap_outer:
                raise ValueError("hsdp: overlap_outer must be the same for every unit of a model")
        self.comms = comm_groups(root.mesh)
        _agree_on_model(root, self.units, self.comms)
        self.outer_sync = outer_sync_of(self.units)  # DiLoCo (None: every step)
        self.groups = [g for u in self.units for g in u.groups]  # same order on every rank
        self.gid = {g: i for i, g in enumerate(self.groups)}
        self._users: dict[ParamGroup, list[Unit]] = {g: [] for g in self.groups}
        self._owner = {g: u for u in self.units for g in u.groups}
        for u in self.units:
            for g in u.uses:
                if g not in self.gid:
                    raise RuntimeError(
                        f"hsdp: {u.label} shares a parameter with {g.label}, which is not part "
                        f"of this model; tie parameters only within one model")
                self._users[g].append(u)
        for u in self.units:
            u.runtime = self
        self.coll = root.collectives
        self.streams = root.streams or Streams.for_device(root.device)
        self.ops = op_table(root.overlap_outer)  # the one place streams are chosen
        self._set_order(list(self.units))  # module order: a first guess until step 1 ends
        self._recording: list[Unit] | None = []
        self.step = StepState()
        self._in_grad_hooks = False  # running the users' post-accumulate-grad hooks
        self._params_written: Event | None = None
        self._holders: dict[ParamGroup, set[Unit]] = {g: set() for g in self.groups}
        self.log = StepLog()
        self.broken: str | None = None  # why hsdp's communicators cannot be used any more
        self._backward_expected = False  # the last root forward's output needs a backward
        self.param_ids = {id(p) for u in self.units for g in u.groups for p in g.sharded}
        self.shards_outer = any(g.shard_outer for g in self.groups)  # hfsdp
        self.float8_groups = [g for g in self.groups if g.float8 is not None]
        self._stepped = False  # an optimizer stepped in the grad hooks now running
        for u in self.units:
            for g in u.groups:
                g.on_all_grads = self._reduce
        self._checked_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._adopted_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        RUNTIMES.add(self)

    def stream_of(self, kind: OpKind) -> SideStream:
        """The side stream ops of ``kind`` are issued on (the op table's entry)."""
        return getattr(self.streams, self.ops[kind].stream)

    @property
    def trainable(self) -> list[ParamGroup]:
        """Groups with gradient state (trainable now or earlier), in group order."""
        return [g for g in self.groups if g.has_grads]

    def synchronize(self) -> None:
        """Block until every stream is idle (state dict, teardown)."""
        self.settle()
        self.streams.drain()
        self.streams.compute.record().synchronize()
