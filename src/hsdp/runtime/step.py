"""``Step``: a model's current step, the one owner of its mutable state: the phase (as
FSDP2's ``TrainingState``), the microbatch flags, what the backward issued, the step log
(``step_log.py``) and whether hsdp's communicators are still usable. The schedule,
recovery, CUDA graphs and units change it only through its methods; ONE ``reset()`` gives
a clean step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hsdp.runtime.step_log import StepLog


class Phase(Enum):
    IDLE = "idle"  # between passes: hsdp's entry points may run
    FORWARD = "forward"  # inside the root's forward
    BACKWARD = "backward"  # from the first pre-backward hook to the finalize
    FAILED = "failed"  # a forward or backward raised: the next entry point abandons the step


_KEPT = ("log", "broken")  # outlive a step: not reset


@dataclass
class Step:
    """Where the current optimizer step is (one per ``Runtime``)."""

    phase: Phase = Phase.IDLE
    first_microbatch: bool = True  # the next backward starts a new step's accumulation
    rs_first: bool = True  # the next reduce-scatter overwrites the inner accumulation
    awaiting_last: bool = False  # a non-last microbatch ran; grads are not final
    sync: bool = True  # this backward communicates (else: local accumulation only)
    is_last: bool = True  # this backward's gradients are final (outer reduction)
    gave_up: bool = False  # this step raised because another rank gave it up
    capturing: bool = False  # this region is being recorded into a CUDA graph
    # (group, RS input, RS event): inputs kept alive until their reduce-scatter is done
    pending_rs: list[tuple[Any, Any, Any]] = field(default_factory=list)
    outer_events: list[Any] = field(default_factory=list)  # this backward's outer reductions
    reduced: list[Any] = field(default_factory=list)  # this backward's groups, in issue order
    log: StepLog = field(default_factory=StepLog)  # the collectives issued since the agreement
    broken: str | None = None  # why hsdp's communicators cannot be used any more

    def reset(self) -> None:
        """A clean state: no step in progress (after an abandoned step); the log and
        ``broken`` are kept."""
        for f in dataclasses.fields(self):
            if f.name not in _KEPT:
                setattr(self, f.name, f.default if f.default_factory is dataclasses.MISSING
                        else f.default_factory())

    def abandon(self) -> None:
        """The step was dropped on every rank: a clean state, and the log of the next."""
        self.reset()
        self.log.next_step()

    def mark_broken(self, why: str) -> str:
        """hsdp's communicators cannot be used any more, because of ``why`` (returned)."""
        self.broken = why
        return why

    def count_forward(self, backward_expected: bool) -> None:
        """A root forward starts. Only forward-only passes since the last agreement
        (evaluation; ``backward_expected`` False): every rank issued all their
        collectives, so the log need not grow with them."""
        if not self.log.microbatches and not backward_expected:
            self.log.forget()
        self.log.count_forward()

    def begin_forward(self, capturing: bool) -> None:
        self.phase, self.capturing = Phase.FORWARD, capturing

    def end_forward(self) -> None:
        self.phase = Phase.IDLE

    def fail_forward(self) -> None:
        """The root's forward raised: the next entry point abandons the step."""
        if self.phase is Phase.FORWARD:
            self.phase = Phase.FAILED

    def give_up(self) -> None:
        """This rank stops waiting: another rank gave the step up."""
        self.gave_up = True

    def begin_backward(self, capturing: bool, sync: bool, is_last: bool | None) -> None:
        """The first pre-backward hook: ``sync`` (gradient sync on), ``is_last`` (the
        user's override; None: the last microbatch)."""
        self.capturing, self.phase = capturing, Phase.BACKWARD
        self.log.count_microbatch()
        self.sync = sync
        self.is_last = (True if is_last is None else is_last) and sync

    def issued_reduce_scatter(self, group: Any, rs_in: Any, event: Any) -> None:
        """``group``'s reduce-scatter of ``rs_in`` was issued (``event``): keep its input."""
        if self.is_last:
            self.reduced.append(group)
        self.pending_rs.append((group, rs_in, event))

    def issued_outer(self, event: Any) -> None:
        self.outer_events.append(event)

    def release_rs_inputs(self, keep: Any = ()) -> list[Any]:
        """Drop the RS inputs of every group not in ``keep``; their events (the
        caller makes compute wait for them before their memory is reused)."""
        kept = [entry for entry in self.pending_rs if entry[0] in keep]
        done = [ev for g, _, ev in self.pending_rs if g not in keep]
        self.pending_rs = kept
        return done

    def take_outer_events(self) -> list[Any]:
        events, self.outer_events = self.outer_events, []
        return events

    def end_backward(self) -> list[Any]:
        """After a backward's finalize: the flags of the next microbatch (the last one of
        a step: the next step's log). Returns the groups reduced, in issue order."""
        if self.is_last:
            self.log.next_step()
        self.awaiting_last = not self.is_last
        self.first_microbatch = self.is_last
        if self.sync:
            self.rs_first = self.is_last
        self.phase = Phase.IDLE
        reduced, self.reduced = self.reduced, []
        return reduced
