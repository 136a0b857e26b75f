"""Gather and prefetch: a unit's all-gathers, their issue order, and freeing the buffers."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from hsdp.runtime.context import RuntimeContext
from hsdp.runtime.hooks import UnshardHandle
from hsdp.runtime.step import Phase
from hsdp.sharding.group import ParamGroup
from hsdp.sharding.write_guard import PENDING
from hsdp.streams.contract import Event
from hsdp.streams.op_table import OpKind

if TYPE_CHECKING:
    from hsdp.runtime.unit import Unit


class Gathering:
    """Which unit's parameters are gathered when: the recorded execution order, the
    units holding each gathered group, the event after which the shards were written."""

    def __init__(self, ctx: RuntimeContext) -> None:
        self.ctx = ctx
        self.set_order(list(ctx.units))  # module order: a first guess until step 1 ends
        self._recording: list[Unit] | None = []  # the first forward's order, until it ends
        self._holders: dict[ParamGroup, set[Unit]] = {g: set() for g in ctx.groups}
        self._params_written: Event | None = None

    def set_order(self, order: list[Unit]) -> None:
        """Forward order; backward runs the root first, then the others in reverse."""
        self.order = order
        self._next_fwd = dict(zip(order, order[1:]))
        bwd = order[:1] + order[1:][::-1]
        self._next_bwd = dict(zip(bwd, bwd[1:]))

    def record(self, unit: Unit) -> None:
        """``unit``'s forward starts: part of the recorded order, if still recording."""
        if self._recording is not None and unit not in self._recording:
            self._recording.append(unit)

    def end_recording(self) -> None:
        """The root's forward ended: the order it ran in is the prefetch order from now."""
        if self._recording is not None:
            unseen = [u for u in self.ctx.units if u not in self._recording]
            self.set_order(self._recording + unseen)
            self._recording = None

    def mark_params_written(self) -> None:
        """The shards may have been written on compute up to now: gathers wait for it."""
        self._params_written = self.ctx.streams.compute.record()

    def issue_unshard(self, unit: Unit) -> None:
        for g in unit.uses:
            if g.gathered_event is None:
                # ag waits: shards were last written on compute (optimizer) or, for hfsdp,
                # by the outer all-gather.
                after = [e for e in (self._params_written, g.params_ready) if e is not None]
                self.ctx.logged(OpKind.GATHER, g, g.unshard(
                    self.ctx.stream_of(OpKind.GATHER), self.ctx.coll, after))

    def prefetch(self, unit: Unit, direction: str) -> None:
        """Issue the all-gathers of the units that run after ``unit`` (its explicit
        prefetch list, else the next unit of the recorded order)."""
        nxt = unit.prefetch[direction]
        if nxt is None:
            order = self._next_fwd if direction == "forward" else self._next_bwd
            nxt = [order[unit]] if unit in order else []
        for u in nxt:
            self.issue_unshard(u)

    def unshard_now(self, unit: Unit) -> None:
        """Gather ``unit`` (if not in flight) and make compute wait for it."""
        self.issue_unshard(unit)
        for g in unit.uses:
            # compute waits: it reads the gathered parameters.
            self.ctx.streams.compute.wait(g.gathered_event)
            PENDING.pop(g, None)  # the wait covers the outer all-gather the gather read
            self._holders[g].add(unit)
        unit.swap(True)

    def unshard(self, unit: Unit) -> UnshardHandle:
        """Explicit ``module.unshard()``: gather ``unit`` now (shards as they are now)."""
        if self.ctx.step.phase is Phase.BACKWARD:
            raise RuntimeError("hsdp: unshard() called during backward")
        if self.ctx.step.phase is Phase.IDLE:
            self.refresh_outer_shards()
            # ag waits: the shards may have been written on compute since the last forward.
            self.mark_params_written()
        self.issue_unshard(unit)
        return UnshardHandle(self, unit)

    def reshard(self, unit: Unit) -> None:
        """Explicit ``module.reshard()``: back to the sharded parameters, buffer freed."""
        if self.ctx.step.phase is Phase.BACKWARD:
            raise RuntimeError("hsdp: reshard() called during backward")
        unit.swap(False)
        self.release(unit)

    def release(self, unit: Unit) -> None:
        """Free the gathered groups ``unit`` uses, unless another running unit (a tie)
        still holds them."""
        free = []
        for g in unit.uses:
            self._holders[g].discard(unit)
            if not self._holders[g] and g.gathered_event is not None:
                free.append(g)
        self._free(free)

    def drop_all(self) -> None:
        """Free every gathered group, held or not (an abandoned step)."""
        for holders in self._holders.values():
            holders.clear()
        self._free([g for g in self.ctx.groups
                    if g.gathered_event is not None])
        if self._recording is not None:
            self._recording = []

    def _free(self, groups: list[ParamGroup]) -> None:
        if groups:
            done = self.ctx.streams.compute.record()
            for g in groups:
                # ag waits: compute must be done reading the buffer before it is reused.
                g.reshard(self.ctx.stream_of(OpKind.FREE_GATHERED), [done])

    def refresh_outer_shards(self) -> None:
        """hfsdp: outer all-gather of every main chunk the optimizer changed, issued at
        once so it overlaps whatever runs until the next forward needs it."""
        stale = [g for u in self.order for g in u.groups
                 if g.inner_shard_stale]
        if stale:
            updated = self.ctx.streams.compute.record()
            for g in stale:
                # outer waits: it reads the main chunk updated on compute.
                kind = g.outer_gather_kind
                ready = self.ctx.logged(kind, g, g.outer_all_gather(
                    self.ctx.stream_of(kind), self.ctx.coll, [updated]))
                # compute waits, before a write into the group's parameters: the all-gather
                # reads main and writes the inner shard that main is a window of.
                PENDING[g] = functools.partial(self.ctx.streams.compute.wait, ready)
