"""The state of a model's current step: its phase (as FSDP2's ``TrainingState``) and the
microbatch flags, with ONE ``reset()`` for a clean step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Phase(Enum):
    IDLE = "idle"  # between passes: hsdp's entry points may run
    FORWARD = "forward"  # inside the root's forward
    BACKWARD = "backward"  # from the first pre-backward hook to the finalize
    FAILED = "failed"  # a forward or backward raised: the next entry point abandons the step


@dataclass
class StepState:
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

    def reset(self) -> None:
        """A clean state: no step in progress (after an abandoned step)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default if f.default_factory is dataclasses.MISSING
                    else f.default_factory())

    def end_backward(self) -> None:
        """After a backward's finalize: the flags of the next microbatch."""
        self.awaiting_last = not self.is_last
        self.first_microbatch = self.is_last
        if self.sync:
            self.rs_first = self.is_last
        self.phase = Phase.IDLE
