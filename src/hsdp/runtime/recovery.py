"""Recovery: abandon a step that raised on some rank, consistently on every rank
(the agreement of ``agreement.py``, then replay of the collectives other ranks issued)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from hsdp.runtime.agreement import Verdict, agree, missing
from hsdp.runtime.context import RuntimeContext
from hsdp.runtime.gather import Gathering
from hsdp.runtime.graphs import Graphs
from hsdp.runtime.hooks import in_backward
from hsdp.runtime.note_board import post_note, read_note
from hsdp.runtime.step import Phase
from hsdp.sharding.group import ParamGroup
from hsdp.streams.contract import Event
from hsdp.streams.op_table import OUTER_GATHERS, OUTER_REDUCTIONS, OpKind
from hsdp.topology.liveness import gone_message


class Recovery:
    """The failure part of a model's runtime: step agreement, abandon and replay."""

    def __init__(self, ctx: RuntimeContext, gathering: Gathering, graphs: Graphs) -> None:
        self.ctx = ctx
        self.gathering = gathering
        self.graphs = graphs

    def agree(self, failed: str, on_slow: Callable[[], None] | None = None) -> Verdict:
        ctx = self.ctx
        used = [u for g in ctx.trainable for u in g.used]
        try:
            return agree(ctx.step.log, failed, used, ctx.comms.control, ctx.comms.timeout,
                         on_slow)
        except RuntimeError as exc:
            ctx.step.mark_broken(str(exc))
            raise

    def note(self, kind: str) -> None:
        """Leave a note for peers blocked in this step (``kind``: failed, ended)."""
        log = self.ctx.step.log
        post_note(f"hsdp/{self.ctx.root.label}/{log.step}",
                  f"{kind} {dist.get_rank()} {log.forwards}")

    def poll(self) -> None:
        """CPU, while a wait blocks: raise if another rank gave up this step, or ended it
        after fewer microbatches than this one runs (it will not join our collectives)."""
        step, log = self.ctx.step, self.ctx.step.log
        note = read_note(f"hsdp/{self.ctx.root.label}/{log.step}")
        if note is None:
            return
        kind, rank, forwards = note.split()
        if kind == "failed":
            step.give_up()
            gone = gone_message()
            raise RuntimeError(
                f"hsdp: rank {rank} gave up step {log.step} (its forward or backward "
                f"raised), so this rank stops waiting for it. {gone + ' ' if gone else ''}"
                f"Handle this like that rank's error: the next forward abandons the step on "
                f"every rank and starts a new one.")
        if int(forwards) < log.forwards:
            step.give_up()
            raise RuntimeError(
                f"hsdp: the ranks disagree on the structure of step {log.step}: rank "
                f"{rank} ended it after {forwards} microbatch(es), this rank runs microbatch "
                f"{log.forwards}. Every rank must run the same number of microbatches "
                f"per step (is_last on the same one).")

    def settle(self) -> None:
        """If the last forward or backward raised (on this rank), abandon that step on
        every rank before anything else runs: the entry points (forward, optimizer step,
        state dict, clip, synchronize) call this; every rank reaches one of them."""
        if self.ctx.step.broken is not None:
            raise RuntimeError(self.ctx.step.broken)
        self.ctx.streams.compute.capturing()  # an entry point: has a capture ended?
        if self.ctx.step.phase is Phase.IDLE or in_backward():
            return
        self.note("failed")
        self.agree(failed="peer" if self.ctx.step.gave_up else "origin")
        self.abandon()

    def abandon(self) -> None:
        """Drop the current step consistently: complete the collectives that other ranks
        issued and this one did not, drain every stream, and reset to a clean state (no
        gradients; the next forward starts a new step)."""
        ctx, log = self.ctx, self.ctx.step.log
        if any(getattr(op.event, "epoch", None) is not None for op in log.ops):
            raise RuntimeError(ctx.step.mark_broken(
                "hsdp: a step being captured in a CUDA graph failed: its collectives were "
                "recorded, not run, on this rank, while other ranks may have replayed "
                "theirs, so it cannot be abandoned consistently. Restart the job."))
        ctx.streams.compute.watch(None)  # every rank is here now: waits will complete
        last: dict[str, Event] = {}
        for op in log.ops:
            last[ctx.ops[op.desc[0]].communicator] = op.event
        keep_alive = []
        try:
            extra = missing(log, ctx.comms.control)
        except RuntimeError as exc:  # nothing can complete the pending collectives
            ctx.streams.fail(exc)
            ctx.step.mark_broken(str(exc))
            raise
        for kind, gid, _ in extra:
            comm = ctx.ops[kind].communicator
            # stream waits: collectives of one communicator must keep their order.
            after = [last[comm]] if comm in last else []
            last[comm] = self._replay(kind, ctx.groups[gid], after, keep_alive)
        ctx.streams.drain()
        ctx.streams.compute.record().synchronize()
        keep_alive.clear()
        for u in ctx.units:
            u.swap(False)
        self.gathering.drop_all()
        for g in ctx.trainable:
            g.abandon_step()
        ctx.release_cleared_grads(self.graphs.graphed)
        ctx.step.abandon()
        ctx.reset_units()

    def _replay(self, kind: OpKind, g: ParamGroup, after: list[Event],
                keep_alive: list) -> Event:
        """Issue a collective another rank issued in the abandoned step, on the stream the
        op table names, on real buffers (their contents are discarded)."""
        stream, coll = self.ctx.stream_of(kind), self.ctx.coll
        if kind is OpKind.GATHER:
            return g.unshard(stream, coll, after)
        if kind in OUTER_REDUCTIONS:
            return g.reduce_outer(stream, coll, after)
        if kind in self.ctx.outer.ops:
            return self.ctx.outer.replay(kind, g, stream, coll, after, keep_alive)
        if kind in OUTER_GATHERS:
            return g.outer_all_gather(stream, coll, after)
        rs_in = torch.zeros(g.layout.total, dtype=g.reduce_dtype, device=g.main.device)
        keep_alive.append(rs_in)
        # rs waits: rs_in was written on compute.
        return g.reduce_scatter(stream, coll, rs_in, True,
                                [*after, self.ctx.streams.compute.record()])
