"""``DiLoCo``: how the outer axis synchronizes when it is not every step (pure settings).

``init_mesh(outer, inner, outer_sync=hsdp.DiLoCo(...))``: every unit sharded on that mesh
trains its outer replica alone (inner FSDP only) and every ``inner_steps`` optimizer steps
averages each fragment's pseudo-gradient over ``outer`` and takes an outer optimizer step
(``runtime/outer_sync.py``; docs/guide/across_datacenters.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from hsdp.ft.errors import FaultToleranceError


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float (an int too large for one is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class DiLoCo:
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

    def check_fault_tolerant(self) -> None:
        """Raise unless each sync's outer step is applied by the time the next fragment
        synchronizes (``delay`` <= the fewest steps between two syncs): with fault
        tolerance each sync is one torchft quorum and one commit, and torchft runs one
        quorum at a time."""
        starts = sorted({self.offset(f) for f in range(self.fragments)})
        gap = min(b - a for a, b in zip(starts, starts[1:] + [starts[0] + self.inner_steps]))
        if self.delay > gap:
            raise FaultToleranceError(
                f"init_mesh: outer_sync=DiLoCo(inner_steps={self.inner_steps}, fragments="
                f"{self.fragments}, delay={self.delay}) with fault_tolerance: each sync is "
                f"one torchft quorum and commit, torchft runs one at a time, and a fragment "
                f"syncs as soon as {gap} step(s) after the previous one; use delay <= {gap}")

    def check_units(self, units: int) -> None:
        """Raise unless the fragments divide ``units`` (the model's fully_shard units)."""
        if units % self.fragments:
            raise ValueError(
                f"hsdp.DiLoCo: fragments={self.fragments} does not divide the model's "
                f"{units} fully_shard units; choose fragments among the divisors of {units}")


def parse_outer_sync(text: str) -> DiLoCo | None:
    """A command line's or environment's outer synchronization: "none" (every step),
    "diloco" (the defaults) or "diloco:inner_steps=50,fragments=4,outer_lr=0.7,..." (any of
    ``DiLoCo``'s fields; bools as true/false or 1/0)."""
    if text == "none":
        return None
    kind, _, settings = text.partition(":")
    if kind != "diloco":
        raise ValueError(f"bad outer sync {text!r}: expected none, diloco or "
                         f"diloco:FIELD=VALUE,... (fields of hsdp.DiLoCo)")
    types = {f.name: type(f.default) for f in fields(DiLoCo)}
    kwargs: dict[str, object] = {}
    for item in filter(None, settings.split(",")):
        name, eq, value = item.partition("=")
        if name not in types or not eq:
            raise ValueError(f"bad outer sync setting {item!r}: expected FIELD=VALUE, FIELD "
                             f"one of {', '.join(types)}")
        kwargs[name] = _value(name, value, types[name])
    return DiLoCo(**kwargs)


def _value(name: str, text: str, kind: type) -> object:
    try:
        if kind is bool:
            return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
        return kind(text)
    except (KeyError, ValueError):
        raise ValueError(f"bad outer sync setting {name}={text!r}: expected "
                         f"{kind.__name__}") from None
