"""DiLoCo on the outer axis, the ``outer_sync`` mode (``init_mesh(outer_sync=
hsdp.DiLoCo(...))``; ``topology/outer_mode.py``): its settings (``DiLoCo``), its refusals,
and WHEN each fragment synchronizes, on which stream (``OuterSync``). Each group's anchor,
outer momentum and outer step: ``sharding/anchor.py``.

Between syncs each outer replica trains alone: the groups have no outer reduction
(``ParamGroup.has_outer_reduction``), so gradients are means over the inner group only.
After the optimizer step that completes a fragment's period (steps ``offset(f)`` mod H,
staggered by H / F), on the optimizer's post-step hook:

1. on compute, per group of the fragment, the fp32 pseudo-gradient ``anchor - main`` (it
   reads the parameters the optimizer updated); the outer stream waits for it (**WHY**:
   written on compute) and all-reduces it over the outer communicator (``OUTER_SYNC``);
2. compute waits for those events (**WHY**: the outer step reads the reduced
   pseudo-gradient), then the outer optimizer updates the anchor and resets ``main``.

With ``delay=d`` > 0 (streaming) step 2 happens ``d`` optimizer steps later, in the
post-step hook of that step: the all-reduce overlaps the forwards, backwards and inner
collectives of those steps; the fragment's parameters are then set to the new anchor.

With fault tolerance (``init_mesh(..., fault_tolerance=...)``) each sync is one torchft
quorum and one commit, as in torchft's own DiLoCo: before step 1, hsdp asks for the
quorum and waits for it (a recovering replica group receives a live one's state in it,
anchors and step counts included, and then syncs what the live groups sync); the
all-reduce runs over the replica groups of the quorum (``CommGroups.grad_outer``); step 2
applies the outer step only if ``Manager.should_commit()``, else the fragment's
parameters go back to its anchor and nothing else changes. A group that failed to commit
while others committed is behind in torchft's step count and recovers from them at the
next quorum. The outer steps due are applied before the next quorum is asked for
(``DiLoCo.check_mesh``: torchft runs one quorum at a time).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hsdp.ft.errors import FaultToleranceError
from hsdp.runtime import diloco_state
from hsdp.sharding.anchor import Anchor
from hsdp.sharding.comm import Collectives
from hsdp.sharding.group import ParamGroup
from hsdp.sharding.policy import Strategy
from hsdp.streams.contract import Event, SideStream
from hsdp.streams.op_table import OpKind, label
from hsdp.topology.outer_mode import Entries, OuterMode, OuterSchedule

if TYPE_CHECKING:
    from hsdp.runtime.context import RuntimeContext
    from hsdp.runtime.unit import Unit


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float (an int too large for one is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class DiLoCo(OuterMode):
    """DiLoCo (arXiv 2311.08105) and its streaming form's fragments (arXiv 2501.18512).

    ``inner_steps`` (H): optimizer steps each outer replica takes alone between two
    synchronizations of a fragment. ``fragments`` (F): the model's units are cut into F
    consecutive fragments (F must divide the number of units); fragment f synchronizes
    at steps ``(f + 1) * H // F`` + multiples of H, so the syncs are staggered by H / F.
    ``outer_lr``, ``momentum``, ``nesterov``: the outer optimizer (SGD on the fp32 anchor
    with the averaged pseudo-gradient ``anchor - parameters``). ``delay`` (streaming):
    the fragment's all-reduce, issued after its period's last step, is applied ``delay``
    steps later, while they compute (0: in the same step); the fragment's parameters are
    then set to the new anchor (the local progress of those steps on it is dropped, as
    torchft's ``fragment_update_alpha=0``). 0 <= delay < H. With H=1, F=1, outer_lr=1,
    momentum=0 and plain SGD inside, training equals synchronous hsdp."""

    inner_steps: int = 100
    fragments: int = 1
    outer_lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    delay: int = 0

    argument: ClassVar[str] = "outer_sync"
    forms: ClassVar[str] = "diloco[:FIELD=VALUE,...] (FIELD a field of hsdp.DiLoCo)"
    reduces_every_step: ClassVar[bool] = False  # each outer replica trains alone
    sync_quorum: ClassVar[bool] = True
    state_key: ClassVar[str] = "hsdp_outer_sync"
    state_name: ClassVar[str] = "DiLoCo state"
    dropped_note: ClassVar[str] = (
        "its DiLoCo state is dropped (this model has no DiLoCo): the parameters and "
        "optimizer state are outer replica 0's (mid-period, the other replicas' steps since "
        "the last sync are not merged in)")
    fresh_note: ClassVar[str] = ("DiLoCo starts afresh (none saved for this layout): anchors "
                                 "from the loaded parameters, zero outer momentum, a new "
                                 "period")

    def __post_init__(self) -> None:
        if not _positive_int(self.inner_steps):
            raise ValueError(f"hsdp.DiLoCo: inner_steps must be an int >= 1 (optimizer steps "
                             f"between outer synchronizations), got {self.inner_steps!r}")
        if not _positive_int(self.fragments):
            raise ValueError(f"hsdp.DiLoCo: fragments must be an int >= 1 dividing the "
                             f"model's units, got {self.fragments!r}")
        lr = self.outer_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"hsdp.DiLoCo: outer_lr must be a number > 0, got {lr!r}")
        if not _finite(lr):
            raise ValueError(f"hsdp.DiLoCo: outer_lr must be finite, got {lr!r}: the first "
                             f"outer step would set every parameter to inf or NaN")
        m = self.momentum
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
            raise ValueError(f"hsdp.DiLoCo: momentum must be a number in [0, 1), got {m!r}")
        d = self.delay
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < self.inner_steps:
            raise ValueError(f"hsdp.DiLoCo: delay must be an int in [0, inner_steps="
                             f"{self.inner_steps}) (steps between a fragment's all-reduce "
                             f"and its outer step), got {d!r}")
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"hsdp.DiLoCo: nesterov must be a bool, got {self.nesterov!r}")

    def offset(self, fragment: int) -> int:
        """The step (mod H) after which ``fragment`` synchronizes."""
        return (fragment + 1) * self.inner_steps // self.fragments % self.inner_steps

    def check_mesh(self, fault_tolerance: Any) -> None:
        """With fault tolerance each sync is one torchft quorum and one commit, and torchft
        runs one quorum at a time: raise unless each sync's outer step is applied by the
        time the next fragment synchronizes (``delay`` <= the fewest steps between two
        syncs), and on a Manager made with an asynchronous quorum (the sync waits for its
        quorum, and a recovering group must receive the state first: torchft's own DiLoCo
        refuses it too)."""
        if fault_tolerance is None:
            return
        starts = sorted({self.offset(f) for f in range(self.fragments)})
        gap = min(b - a for a, b in zip(starts, starts[1:] + [starts[0] + self.inner_steps]))
        if self.delay > gap:
            raise FaultToleranceError(
                f"init_mesh: outer_sync=DiLoCo(inner_steps={self.inner_steps}, fragments="
                f"{self.fragments}, delay={self.delay}) with fault_tolerance: each sync is "
                f"one torchft quorum and commit, torchft runs one at a time, and a fragment "
                f"syncs as soon as {gap} step(s) after the previous one; use delay <= {gap}")
        if getattr(fault_tolerance, "_use_async_quorum", False):  # torchft 0.2.0's attribute
            raise FaultToleranceError(
                "init_mesh: outer_sync=DiLoCo(...) with a torchft Manager made with "
                "use_async_quorum=True: each sync waits for its quorum (a recovering group "
                "receives the anchors before the outer step); make it with "
                "use_async_quorum=False, or pass hsdp.FaultTolerance(...)")

    @classmethod
    def parse(cls, text: str) -> DiLoCo | None:
        """"diloco" (the defaults) or "diloco:inner_steps=50,fragments=4,outer_lr=0.7,..."
        (any field; bools as true/false or 1/0); None for another mode's text."""
        kind, _, settings = text.partition(":")
        if kind != "diloco":
            return None
        types = {f.name: type(f.default) for f in fields(cls)}
        kwargs: dict[str, object] = {}
        for item in filter(None, settings.split(",")):
            name, eq, value = item.partition("=")
            if name not in types or not eq:
                raise ValueError(f"bad outer sync setting {item!r}: expected FIELD=VALUE, "
                                 f"FIELD one of {', '.join(types)}")
            kwargs[name] = _value(name, value, types[name])
        return cls(**kwargs)

    def check_shard(self, strategy: Strategy, comms: Any, device: Any, params: list,
                    names: list[str]) -> None:
        """hfsdp shards gradients and optimizer state over outer: a replica cannot step
        alone."""
        if strategy is Strategy.HFSDP:
            raise ValueError(
                "fully_shard: strategy='hfsdp' cannot train with outer_sync=DiLoCo(...): its "
                "gradients and optimizer state are sharded over the outer axis, so an outer "
                "replica cannot step alone between synchronizations. Use strategy='hsdp'")

    def attach(self, group: ParamGroup) -> None:
        """A trainable group's anchor and outer momentum (``anchor.py``)."""
        if group.requires_grad:
            group.anchor = Anchor(self)

    def schedule(self, units: Sequence[Unit]) -> OuterSync:
        return OuterSync(self, units)

    def capture_refusal(self, group: ParamGroup) -> tuple[str, str]:
        return ("DiLoCo's outer synchronization (init_mesh(outer_sync=...))",
                "run DiLoCo eagerly")

    def hook_refusal(self, group: ParamGroup) -> str:
        return ("init_mesh(outer_sync=...): DiLoCo has no per-step outer all-reduce for the "
                "hook to follow")

    def state_dict(self, group: ParamGroup, opt_state: Mapping | None) -> Entries:
        """Its anchor, momentum and clocks, and each replica's own values
        (``diloco_state.py``)."""
        return {} if group.anchor is None else diloco_state.state(group, opt_state)

    def load_state_dict(self, group: ParamGroup, state: Entries,
                        opt_state: Mapping | None) -> None:
        if group.anchor is not None:
            diloco_state.load(group, state, opt_state)

    def restore_after_model_load(self, group: ParamGroup, state: Entries,
                                 opt_state: Mapping | None) -> None:
        """Each replica's own parameters, which the model's entries (outer replica 0's)
        wrote over."""
        if group.anchor is not None:
            diloco_state.restore_replica_local(group, state, opt_state)

    def replica_state(self, group: ParamGroup) -> dict | None:
        return None if group.anchor is None else group.anchor.shared()

    def recover(self, group: ParamGroup, state: dict | None) -> None:
        if group.anchor is not None:
            group.anchor.recover(state, group.main.device)

    def check_units(self, units: int) -> None:
        """Raise unless the fragments divide ``units`` (the model's fully_shard units)."""
        if units % self.fragments:
            raise ValueError(
                f"hsdp.DiLoCo: fragments={self.fragments} does not divide the model's "
                f"{units} fully_shard units; choose fragments among the divisors of {units}")


def _value(name: str, text: str, kind: type) -> object:
    try:
        if kind is bool:
            return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
        return kind(text)
    except (KeyError, ValueError):
        raise ValueError(f"bad outer sync setting {name}={text!r}: expected "
                         f"{kind.__name__}") from None


class OuterSync(OuterSchedule):
    """The DiLoCo schedule of one model: its fragments and their outer steps."""

    ops: ClassVar[tuple[OpKind, ...]] = (OpKind.OUTER_SYNC,)

    def __init__(self, config: DiLoCo, units: Sequence[Unit]) -> None:
        config.check_units(len(units))
        per = len(units) // config.fragments
        self.config = config
        self.fragments = [[g for u in units[f * per:(f + 1) * per] for g in u.groups
                           if g.anchor is not None] for f in range(config.fragments)]
        self.groups = [g for fragment in self.fragments for g in fragment]
        # fault tolerance: torchft's replica groups; the Manager's step after hsdp's last
        # commit (None: none yet), to tell a training loop that commits on its own
        self.elastic = self.groups[0].comms.elastic if self.groups else None
        self._committed: int | None = None
        # optimizer -> its number of parameters when check_optimizer accepted it
        self._checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise before the step unless ``optimizer`` holds every trainable parameter of
        the model: the outer step counts this optimizer's steps."""
        params = [p for pg in optimizer.param_groups for p in pg["params"]]
        if self._checked.get(optimizer) == len(params):
            return  # checked, and its parameters did not change since
        held = {id(p) for p in params}
        missing = sum(p.requires_grad and id(p) not in held
                      for g in self.groups for p in (q.sharded for q in g.params))
        if missing:
            raise ValueError(
                f"hsdp.DiLoCo: this optimizer does not hold {missing} trainable parameter(s) "
                f"of the model; with init_mesh(outer_sync=DiLoCo(...)) one optimizer must step "
                f"all of them (its steps are the inner steps), not one per parameter or part")
        self._checked[optimizer] = len(params)

    def before_step(self) -> None:
        """Take the anchors still missing from the parameters (on compute, before the
        optimizer changes them)."""
        for g in self.groups:
            g.anchor.capture(g.main)

    def due(self) -> list[ParamGroup]:
        """The groups of the fragments whose period the step count completes."""
        cfg = self.config
        return [g for f, fragment in enumerate(self.fragments) for g in fragment
                if g.anchor.steps % cfg.inner_steps == cfg.offset(f)]

    def after_step(self, rt: RuntimeContext) -> None:
        """Count the step, apply the outer steps due now (issued ``delay`` steps ago),
        issue the all-reduces of the fragments whose period it completes (with fault
        tolerance after torchft's quorum), then apply those due at once (``delay=0``)."""
        for g in self.groups:
            g.anchor.count_step()
        self._apply(rt)
        due = self.due()
        if due and self.elastic is not None:
            due = self._quorum(rt)
        if due:
            for g in due:  # on compute: it reads the parameters the optimizer updated
                g.anchor.take_pseudo_grad(g.main, g.anchor.steps + self.config.delay)
            taken = rt.streams.compute.record()
            stream = rt.stream_of(OpKind.OUTER_SYNC)
            for g in due:
                g.anchor.issued(rt.logged(OpKind.OUTER_SYNC, g,
                                          self.reduce(g, stream, rt.coll, [taken])))
        self._apply(rt)

    def _quorum(self, rt: RuntimeContext) -> list[ParamGroup]:
        """torchft's quorum for this sync, waited for (a recovering group receives a live
        one's state in it); the groups due by the step count it then has."""
        manager = self.elastic.manager
        if self._committed is not None and manager.current_step() != self._committed:
            raise RuntimeError(
                "hsdp: with init_mesh(outer_sync=DiLoCo(...), fault_tolerance=...) hsdp runs "
                "torchft's quorum and commit of each sync inside optimizer.step(); the "
                "training loop must not call manager.start_quorum() / should_commit()")
        rt.streams.compute.record().synchronize()  # torchft's thread may send the state
        manager.start_quorum()
        return self.due()

    def _apply(self, rt: RuntimeContext) -> None:
        """The outer steps due at this step count (with fault tolerance, only if the sync
        commits; else the parameters go back to the anchor)."""
        ready = [g for g in self.groups if g.anchor.apply_at == g.anchor.steps]
        if not ready:
            return
        for g in ready:
            if g.anchor.reduced is not None:
                # compute waits: the outer step reads the reduced pseudo-gradient.
                rt.streams.compute.wait(g.anchor.reduced)
        commit = True
        if self.elastic is not None:  # after the all-reduce: torchft synchronizes the device
            commit = self.elastic.manager.should_commit()
            self._committed = self.elastic.manager.current_step()
        with torch.no_grad():
            for g in ready:
                if commit:
                    g.anchor.apply(g.main)
                else:
                    g.anchor.discard(g.main)

    @staticmethod
    def reduce(g: ParamGroup, stream: SideStream, coll: Collectives,
               after: Sequence[Event]) -> Event:
        """``g``'s pseudo-gradient all-reduce on ``stream`` (outer waits: the
        pseudo-gradient was written on compute). Compute does not touch it until it
        waited for the returned event."""
        return stream.submit(lambda: g.anchor.reduce(coll, g.comms.grad_outer, g.compressed),
                             after, label(OpKind.OUTER_SYNC, g.label))

    @staticmethod
    def replay(kind: OpKind, g: ParamGroup, stream: SideStream, coll: Collectives,
               after: Sequence[Event], keep_alive: list) -> Event:
        """The all-reduce of an abandoned step that another rank issued, on scratch."""
        scratch = torch.zeros(g.main.numel(), dtype=torch.float32, device=g.main.device)
        keep_alive.append(scratch)

        def run() -> None:
            if g.compressed is None:
                coll.all_reduce(scratch, g.comms.grad_outer, "outer", avg=True)
            else:  # the same collectives, the residual kept as it was
                g.compressed.all_reduce(coll, scratch, scratch, g.comms.outer, avg=True)
                g.compressed.drop()
        return stream.submit(run, after, label(OpKind.OUTER_SYNC, g.label))
