"""Recovery: abandon a step that raised on some rank, consistently on every rank
(the agreement of ``agreement.py``, then replay of the collectives other ranks issued)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from hsdp.runtime.hooks import in_backward
from hsdp.runtime.state import Phase
from hsdp.runtime.step_agreement import Verdict, agree, missing, post_note, read_note
from hsdp.sharding.group import ParamGroup
from hsdp.streams.contract import Event
from hsdp.streams.op_table import OUTER_REDUCTIONS, OpKind


class Recovery:
    """The failure part of ``Runtime``: step agreement, abandon and replay."""

    def _agree(self, failed: str, on_slow: Callable[[], None] | None = None) -> Verdict:
        used = [u for g in self.trainable for u in g.used]
        try:
            return agree(self.log, failed, used, self.comms.control, self.comms.timeout,
                         on_slow)
        except RuntimeError as exc:
            self.broken = str(exc)
            raise

    def _note(self, kind: str) -> None:
        post_note(f"hsdp/{self.root.label}/{self.log.step}",
                  f"{kind} {dist.get_rank()} {self.log.forwards}")

    def _poll(self) -> None:
        """CPU, while a wait blocks: raise if another rank gave up this step, or ended it
        after fewer microbatches than this one runs (it will not join our collectives)."""
        note = read_note(f"hsdp/{self.root.label}/{self.log.step}")
        if note is None:
            return
        kind, rank, forwards = note.split()
        if kind == "failed":
            self.step.gave_up = True
            raise RuntimeError(
                f"hsdp: rank {rank} gave up step {self.log.step} (its forward or backward "
                f"raised), so this rank stops waiting for it. Handle this like that rank's "
                f"error: the next forward abandons the step on every rank and starts a new one.")
        if int(forwards) < self.log.forwards:
            self.step.gave_up = True
            raise RuntimeError(
                f"hsdp: the ranks disagree on the structure of step {self.log.step}: rank "
                f"{rank} ended it after {forwards} microbatch(es), this rank runs microbatch "
                f"{self.log.forwards}. Every rank must run the same number of microbatches "
                f"per step (is_last on the same one).")

    def settle(self) -> None:
        """If the last forward or backward raised (on this rank), abandon that step on
        every rank before anything else runs: the entry points (forward, optimizer step,
        state dict, clip, synchronize) call this; every rank reaches one of them."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if self.step.phase is Phase.IDLE or in_backward():
            return
        self._note("failed")
        self._agree(failed="peer" if self.step.gave_up else "origin")
        self._abandon()

    def _abandon(self) -> None:
        """Drop the current step consistently: complete the collectives that other ranks
        issued and this one did not, drain every stream, and reset to a clean state (no
        gradients; the next forward starts a new step)."""
        self.streams.compute.poll = None  # every rank is here now: waits will complete
        last: dict[str, Event] = {}
        for op in self.log.ops:
            last[self.ops[op.desc[0]].communicator] = op.event
        keep_alive = []
        try:
            extra = missing(self.log, self.comms.control)
        except RuntimeError as exc:  # nothing can complete the pending collectives
            self.streams.failed.append(exc)
            self.broken = str(exc)
            raise
        for kind, gid, _ in extra:
            comm = self.ops[kind].communicator
            # stream waits: collectives of one communicator must keep their order.
            after = [last[comm]] if comm in last else []
            last[comm] = self._replay(kind, self.groups[gid], after, keep_alive)
        self.streams.drain()
        self.streams.compute.record().synchronize()
        keep_alive.clear()
        for u in self.units:
            u.swap(False)
        for holders in self._holders.values():
            holders.clear()
        self._free([g for g in self.groups if g.gathered_event is not None])
        for g in self.trainable:
            g.abandon_step()
        self._release_cleared_grads()
        self.step.reset()
        self._reset_units()
        if self._recording is not None:
            self._recording = []
        self.log.next_step()

    def _replay(self, kind: OpKind, g: ParamGroup, after: list[Event],
                keep_alive: list) -> Event:
        """Issue a collective another rank issued in the abandoned step, on the stream the
        op table names, on real buffers (their contents are discarded)."""
        stream = self.stream_of(kind)
        if kind is OpKind.GATHER:
            return g.unshard(stream, self.coll, after)
        if kind in OUTER_REDUCTIONS:
            return g.outer_reduce(stream, self.coll, after)
        if kind is OpKind.OUTER_SYNC:
            return self.outer_sync.replay(g, stream, self.coll, after, keep_alive)
        if kind is OpKind.OUTER_ALL_GATHER:
            return g.outer_all_gather(stream, self.coll, after)
        rs_in = torch.zeros(g.layout.total, dtype=g.reduce_dtype, device=g.main.device)
        keep_alive.append(rs_in)
        # rs waits: rs_in was written on compute.
        return g.reduce_scatter(stream, self.coll, rs_in, True,
                                [*after, self.streams.compute.record()])
