"""The outer modes' registration: which ``OuterMode`` (``topology/outer_mode.py``) each
argument takes, and the one place that reads the user's value of it (an instance, a
short form, None), and a model's outer schedule. A new mode is its own file plus one
entry in ``MODES``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hsdp.runtime.diloco import DiLoCo
from hsdp.sharding.outer_gather import OuterGather
from hsdp.sharding.outer_reduce import OuterReduce
from hsdp.topology.outer_mode import OuterMode, OuterSchedule

if TYPE_CHECKING:
    from hsdp.runtime.unit import Unit

# argument -> the modes it takes, in the order their short forms are tried
MODES: dict[str, tuple[type[OuterMode], ...]] = {
    "outer_reduce": (OuterReduce,),
    "outer_gather": (OuterGather,),
    "outer_sync": (DiLoCo,),
}


def parse_mode(argument: str, text: str) -> OuterMode | None:
    """A command line's or environment's ``argument``: "none", or a short form of one of
    its modes ("int8", "fp8_e4m3:128", "diloco:inner_steps=50,fragments=4")."""
    if text == "none":
        return None
    for mode in MODES[argument]:
        parsed = mode.parse(text)
        if parsed is not None:
            return parsed
    forms = " or ".join(m.forms for m in MODES[argument])
    raise ValueError(f"bad {argument} {text!r}: expected none or {forms}")


def as_mode(argument: str, value: object) -> OuterMode | None:
    """``fully_shard``'s ``argument`` (and ``outer_sync``'s): one of its modes, None (the
    exact outer axis), or a short form (``parse_mode``)."""
    modes = MODES[argument]
    if value is None or isinstance(value, modes):
        return value
    if isinstance(value, str):
        return parse_mode(argument, value)
    names = " or ".join(f"an hsdp.{m.__name__}" for m in modes)
    forms = " or ".join(f"'{m.forms}'" for m in modes)
    raise TypeError(f"fully_shard: {argument} must be {names}, its short form {forms} or "
                    f"None, got {value!r}")


def model_schedule(units: Sequence[Unit]) -> OuterSchedule:
    """The outer schedule of the model made of ``units``: its ``outer_sync`` mode's (one
    for every unit), else the base one (the backward's reductions are all)."""
    syncs = {next((m for m in g.outer if m.argument == "outer_sync"), None)
             for u in units for g in u.groups}
    if len(syncs) > 1:
        raise ValueError(f"hsdp: the model's units were sharded on meshes with different "
                         f"outer_sync settings ({sorted(map(str, syncs))}); shard every "
                         f"unit of a model on the same mesh")
    mode = next(iter(syncs), None)
    schedule = None if mode is None else mode.schedule(units)
    return OuterSchedule() if schedule is None else schedule
