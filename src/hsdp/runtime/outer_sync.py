"""DiLoCo on the outer axis (``init_mesh(outer_sync=hsdp.DiLoCo(...))``): WHEN each
fragment synchronizes, on which stream.

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
(``DiLoCo.check_fault_tolerant``: torchft runs one quorum at a time).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hsdp.sharding.comm import Collectives
from hsdp.sharding.group import ParamGroup
from hsdp.streams.contract import Event, SideStream
from hsdp.streams.op_table import OpKind, label
from hsdp.topology.outer_sync import DiLoCo

if TYPE_CHECKING:
    from hsdp.runtime.context import RuntimeContext
    from hsdp.runtime.unit import Unit


class OuterSync:
    """The DiLoCo schedule of one model: its fragments and their outer steps."""

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
                      for g in self.groups for p in g.sharded)
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
    def replay(g: ParamGroup, stream: SideStream, coll: Collectives, after: Sequence[Event],
               keep_alive: list) -> Event:
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


def outer_sync_of(units: Sequence[Unit]) -> OuterSync | None:
    """The DiLoCo schedule of the model made of ``units`` (None: synchronous); every unit
    must be sharded on meshes with the same ``outer_sync``."""
    configs = {g.comms.outer_sync for u in units for g in u.groups}
    if len(configs) > 1:
        raise ValueError(f"hsdp: the model's units were sharded on meshes with different "
                         f"outer_sync settings ({sorted(map(str, configs))}); shard every "
                         f"unit of a model on the same mesh")
    config = next(iter(configs), None)
    return None if config is None else OuterSync(config, units)


