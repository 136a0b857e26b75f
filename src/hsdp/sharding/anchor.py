"""One group's DiLoCo state (``hsdp.DiLoCo``): the fp32 anchor (the parameters as of the
fragment's last outer step, the same on every outer replica), the outer optimizer's
momentum and the optimizer steps counted, with the math of one outer step. WHEN it runs,
on which stream: ``runtime/diloco.py``."""

from __future__ import annotations

from typing import Protocol

import torch

from hsdp.sharding.comm import Collectives
from hsdp.sharding.compressed import CompressedOuter
from hsdp.streams.contract import Event


class OuterOptimizer(Protocol):
    """The outer optimizer's settings (``hsdp.DiLoCo``'s)."""

    outer_lr: float
    momentum: float
    nesterov: bool


class Anchor:
    """The outer state of one group's shard ``main`` (hsdp: replicated over outer)."""

    def __init__(self, config: OuterOptimizer) -> None:
        self.config = config
        self.anchor: torch.Tensor | None = None  # None: taken from main at the next step
        self.momentum: torch.Tensor | None = None
        self.steps = 0  # optimizer steps taken (the sync schedule's clock)
        self.pseudo_grad: torch.Tensor | None = None  # issued, until applied
        self.apply_at: int | None = None  # the step count at which it is applied
        self.reduced: Event | None = None  # its all-reduce (None: done)

    def count_step(self) -> None:
        """An optimizer step was taken (the sync schedule's clock)."""
        self.steps += 1

    def issued(self, reduced: Event) -> None:
        """The all-reduce of the pseudo-gradient taken last was issued (``reduced``)."""
        self.reduced = reduced

    def capture(self, main: torch.Tensor) -> None:
        """Take the anchor from ``main`` if there is none (first step, after a load of a
        checkpoint without one)."""
        if self.anchor is None:
            self.anchor = main.detach().to(torch.float32, copy=True)

    def take_pseudo_grad(self, main: torch.Tensor, apply_at: int) -> None:
        """The pseudo-gradient ``anchor - main`` in fp32 (on compute), to be applied when
        the step count reaches ``apply_at``."""
        self.pseudo_grad = self.anchor - main
        self.apply_at = apply_at

    def reduce(self, coll: Collectives, group: object,
               compressed: CompressedOuter | None = None) -> None:
        """Average the pseudo-gradient over ``group`` (the outer communicator, or torchft's
        replica groups with fault tolerance; a SUM and a division where the backend has no
        AVG); with ``compressed`` (the compressed outer reduction) in 8 bits, its
        error-feedback residual committed at once (nothing abandons it)."""
        if compressed is None:
            coll.all_reduce(self.pseudo_grad, group, "outer", avg=True)
            return
        compressed.all_reduce(coll, self.pseudo_grad, self.pseudo_grad, group, avg=True)
        compressed.commit()

    def apply(self, main: torch.Tensor) -> None:
        """The outer optimizer step on the anchor with the reduced pseudo-gradient (SGD,
        momentum, Nesterov), then the parameters reset to it."""
        cfg, pg = self.config, self.pseudo_grad
        if cfg.momentum:
            if self.momentum is None:
                self.momentum = torch.zeros_like(pg)
            self.momentum.mul_(cfg.momentum).add_(pg)
            update = pg.add(self.momentum, alpha=cfg.momentum) if cfg.nesterov else self.momentum
        else:
            update = pg
        self.anchor.sub_(update, alpha=cfg.outer_lr)
        main.copy_(self.anchor)
        self.pseudo_grad = self.apply_at = self.reduced = None

    def discard(self, main: torch.Tensor) -> None:
        """A sync that did not commit (fault tolerance): no outer step; the parameters go
        back to the anchor (as torchft's DiLoCo restores them) and the pseudo-gradient is
        dropped."""
        main.copy_(self.anchor)
        self.pseudo_grad = self.apply_at = self.reduced = None

    def shared(self) -> dict[str, torch.Tensor | int | None]:
        """What a recovering replica group receives (views; nothing is pending when a
        quorum asks for it): the anchor, the outer momentum, the step count."""
        return {"anchor": self.anchor, "momentum": self.momentum, "steps": self.steps}

    def recover(self, state: dict[str, torch.Tensor | int | None],
                device: torch.device) -> None:
        """Take a live replica group's ``shared()`` (received: tensors of its own)."""
        self.anchor = state["anchor"].to(device, torch.float32)
        momentum = state["momentum"]
        self.momentum = None if momentum is None else momentum.to(device, torch.float32)
        self.steps = int(state["steps"])
        self.pseudo_grad = self.apply_at = self.reduced = None

    def state(self, main: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies for a checkpoint (the streams drained): anchor (``main`` if none yet),
        momentum and pending pseudo-gradient (zeros if none), steps and the step count
        the pending one applies at (-1: none), 0-d int64s."""
        anchor = main.float() if self.anchor is None else self.anchor
        zeros = torch.zeros_like(anchor)
        momentum = zeros if self.momentum is None else self.momentum
        pending = zeros if self.pseudo_grad is None else self.pseudo_grad
        return {"anchor": anchor.clone(), "momentum": momentum.clone(),
                "pending": pending.clone(), "steps": torch.tensor(self.steps),
                "apply_at": torch.tensor(-1 if self.apply_at is None else self.apply_at)}

    def load(self, state: dict[str, torch.Tensor] | None, device: torch.device) -> None:
        """Set from ``state``'s form; None (a checkpoint without it): start afresh, the
        anchor taken from the loaded parameters at the next step."""
        self.reduced = None
        if state is None:
            self.anchor = self.momentum = self.pseudo_grad = self.apply_at = None
            self.steps = 0
            return
        self.anchor = state["anchor"].to(device, torch.float32, copy=True)
        self.momentum = (state["momentum"].to(device, torch.float32, copy=True)
                         if self.config.momentum else None)
        self.steps = int(state["steps"])
        apply_at = int(state["apply_at"])
        self.apply_at = None if apply_at < 0 else apply_at
        self.pseudo_grad = (None if self.apply_at is None else
                            state["pending"].to(device, torch.float32, copy=True))
