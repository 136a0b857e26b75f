"""CUDA graphs: what a model's runtime does differently when its forward, backward or
optimizer step is recorded into a CUDA graph (docs/design.md, "CUDA graphs").

The host runs hsdp's hooks once, while the graph is captured; each replay runs only
what they issued on the device. So:

- each of hsdp's regions (root forward, backward, optimizer step) asks the streams at
  its start whether it is being captured (``enter``), and refuses, before it changes
  anything, what cannot be recorded (``refusals``);
- a captured region ends with every side stream joined into compute (``Streams.drain``:
  device-side waits), as CUDA requires; once a model was captured, eager regions end so
  too, so that a later replay on compute is ordered after their side-stream work;
- the step agreement (a CPU collective) is not run inside a capture: the captured step's
  structure is kept (``captured``) and agreed on outside the graph, before each optimizer
  step (``check_replayed``), with a watchdog on the previous step's device work; a rank
  that failed, died or diverged still ends in an error on every rank;
- the compressed outer reduction keeps its error-feedback residual in fixed buffers from
  the first capture on, the pending one chosen on the device (``compressed.py``);
- the gradients must stay set between replays (``zero_grad(set_to_none=False)``): a
  captured backward adds into them, and nothing may free their buffers.
"""

from __future__ import annotations

import dataclasses

import torch

from hsdp.runtime.agreement import Agreement
from hsdp.runtime.context import RuntimeContext
from hsdp.runtime.step import Phase
from hsdp.runtime.step_log import Issued, StepLog
from hsdp.streams.capture import capture_refusal
from hsdp.streams.contract import Event

CLEARED = ("the gradients were cleared with zero_grad(set_to_none=True) while a captured "
           "backward writes them")
CLEAR_INSTEAD = ("clear them with optimizer.zero_grad(set_to_none=False) (torchtitan does "
                 "so under CUDA graphs), and run one eager step before capturing")


class Graphs:
    """The CUDA graph part of a model's runtime."""

    def __init__(self, ctx: RuntimeContext) -> None:
        self.ctx = ctx
        self.captured: StepLog | None = None  # the last captured step's structure
        self.used: list[bool] = []  # its parameters' gradient flags on this rank
        self.steps = 0  # optimizer steps since the model was first captured
        self._last_step_done: Event | None = None  # the watchdog's event
        self._pending: Agreement | None = None  # the last step's agreement, not read yet
        self._due = self._fresh = True  # a check is due; read its verdict at once
        self.graphed = False  # a region of this model was captured in a CUDA graph

    def enter(self, region: str) -> bool:
        """At the start of ``region`` ("forward", "optimizer step", "entry"): is it being
        captured? Refuses what cannot be, naming it, before anything changes."""
        capturing = self.ctx.streams.compute.capturing()
        if capturing:
            bad = self.refusals(region)
            if bad:
                raise capture_refusal(*bad[0])
            for g in self.ctx.groups:
                for m in g.outer:
                    m.before_capture(g)
            self.graphed = True
        return capturing

    def refusals(self, region: str) -> list[tuple[str, str]]:
        """(what, what to do instead) for each thing ``region`` holds that a capture
        cannot record."""
        ctx, groups = self.ctx, self.ctx.groups
        out = []
        if ctx.step.phase is Phase.FAILED:
            out.append(("abandoning a failed step (it drains the streams on the host)",
                        "run the next forward or optimizer step eagerly after a failure"))
        if ctx.comms.elastic is not None:
            out.append(("fault tolerance (torchft's quorum waits on the host)",
                        "run fault-tolerant training eagerly"))
        out += dict.fromkeys(filter(None, (m.capture_refusal(g) for g in groups
                                           for m in g.outer)))  # each once, in order
        if any(g.float8 is not None for g in groups):
            out.append(("the float8 all-gather (its scales are refreshed through host "
                        "collectives)", "run float8 all-gather models eagerly"))
        if region == "forward" and not ctx.root.gradient_sync:
            out.append(("a backward without gradient sync (set_requires_gradient_sync("
                        "False) keeps gradients across regions)",
                        "use hsdp.microbatch(model, is_last=...) inside one captured region"))
        if region == "forward" and ctx.step.first_microbatch and torch.is_grad_enabled():
            if any(g.requires_grad and not (g.grads_live and g.grads_exposed())
                   for g in groups):
                out.append(("a backward whose gradients are not set (cleared with "
                            "zero_grad(set_to_none=True), or no eager step ran yet)",
                            CLEAR_INSTEAD))
        return out

    def end_region(self, capturing: bool) -> None:
        """The end of a region: join the side streams into compute (see the module
        docstring), if captured or once the model was."""
        if capturing or self.graphed:
            self.ctx.streams.drain()

    def keep_captured(self) -> None:
        """A captured step's finalize: keep its structure and gradient flags for the
        agreement outside the graph; the next check reads its verdict at once."""
        log = self.ctx.step.log
        self.captured = StepLog(forwards=log.forwards, microbatches=log.microbatches,
                                ops=[Issued(op.desc, None) for op in log.ops])
        self.used = [u for g in self.ctx.trainable for u in g.used]
        self._due = self._fresh = True

    def step_done(self) -> None:
        """An optimizer step of this model ended: the next one checks again (nested
        optimizers, e.g. torchtitan's container, step the model once)."""
        self._due = True

    def check_replayed(self) -> None:
        """Before an eager optimizer step of a captured model (once per step): the
        watchdog (the previous step's device work finished within the timeout), the
        gradients still set, and the step agreement on the captured structure, on every
        rank. The agreement of a step is read at the next one (its collective has long
        finished by then, so the host never waits for it), except the first after a
        capture. Then the gradients of parameters some other rank used are exposed here."""
        ctx = self.ctx
        if not self.graphed or self.captured is None or not self._due:
            return
        self._due = False
        self._watch()
        cleared = [g.label for g in ctx.trainable if not g.grads_exposed()]
        captured = dataclasses.replace(self.captured, step=self.steps)
        self.steps += 1
        previous, self._pending = self._pending, Agreement(
            captured, "origin" if cleared else "", self.used, ctx.comms.control,
            ctx.comms.timeout)
        if self._fresh or cleared:  # read this step's at once
            self._fresh = False
            if previous is not None:
                self._read(previous)
            previous, self._pending = self._pending, None
        if cleared:
            raise capture_refusal(f"a step in which {CLEARED} ({', '.join(cleared[:3])})",
                                  CLEAR_INSTEAD)
        if previous is not None:
            self._read(previous)

    def _read(self, agreement: Agreement) -> None:
        """Raise on every rank if a rank failed or captured another step; expose the
        gradients that some other rank gave a parameter."""
        ctx = self.ctx
        try:
            verdict = agreement.verdict()
        except RuntimeError as exc:
            ctx.step.mark_broken(str(exc))
            raise
        if not verdict.ok:
            raise RuntimeError(ctx.step.mark_broken(verdict.message(agreement.step) + (
                " The ranks captured different steps, so their graphs' collectives do not "
                "match: restart the job.")))
        if verdict.used != self.used:
            used = iter(verdict.used)
            for g in ctx.trainable:
                g.expose_used([next(used) for _ in g.used])

    def _watch(self) -> None:
        """Raise if the device work issued before the previous optimizer step has not
        finished within the timeout (a replayed collective whose peer never came)."""
        prev, self._last_step_done = self._last_step_done, self.ctx.streams.compute.record()
        if prev is not None and not prev.wait_for(self.ctx.comms.timeout.total_seconds()):
            raise RuntimeError(self.ctx.step.mark_broken(
                f"hsdp: the replayed steps of a CUDA graph did not finish within the "
                f"timeout ({self.ctx.comms.timeout}): a peer rank died, is stuck, or "
                f"replayed another number of times. hsdp's communicators cannot be used "
                f"any more: restart the job."))
