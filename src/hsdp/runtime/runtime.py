"""``Runtime``: what the root unit of a model shares with every unit below it. It builds
the shared state (``RuntimeContext``, ``context.py``) and the parts that receive it: the
schedule (``schedule.py``: forward, backward, reduction), the all-gathers (``gather.py``),
recovery (``recovery.py``), CUDA graphs (``graphs.py``) and the optimizer steps
(``optim_steps.py``); and forwards the entry points the units, the public API and tools
call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import hsdp.streams.teardown  # noqa: F401  (destroy_process_group waits for hsdp's streams)
from hsdp.runtime.context import RuntimeContext
from hsdp.runtime.gather import Gathering
from hsdp.runtime.graphs import Graphs
from hsdp.runtime.hooks import units_below
from hsdp.runtime.optim_hooks import STEPPERS
from hsdp.runtime.optim_steps import OptimizerSteps
from hsdp.runtime.outer_modes import model_schedule
from hsdp.runtime.recovery import Recovery
from hsdp.runtime.schedule import Schedule
from hsdp.runtime.step import Step
from hsdp.streams.op_table import op_table
from hsdp.streams.stream_set import Streams
from hsdp.topology.build_agreement import agree_on_group
from hsdp.topology.communicators import CommGroups, comm_groups

if TYPE_CHECKING:
    from hsdp.runtime.unit import Unit


def _agree_on_model(root: Unit, units: list[Unit], comms: CommGroups) -> None:
    """Raise on every rank, naming the first difference, unless every rank sharded the
    same model the same way: otherwise the collectives would not match (a hang, an abort,
    or silently different "replicated" parameters)."""
    path = {id(m): n for n, m in root.module.named_modules()}
    lines = [f"{len(units)} units"] + [
        f"unit {path.get(id(u.module)) or '<root>'}: {line}"
        for u in units for line in u.description]
    agree_on_group("model", lines, comms.control, comms.timeout,
                   "Every rank must build the same model and call fully_shard on the same "
                   "modules with the same options.")



class Runtime:
    """A model's runtime: owns its parts, each given the shared ``RuntimeContext``."""

    def __init__(self, root: Unit) -> None:
        units = list(units_below(root.module))
        for u in units:
            if u.runtime is not None:
                raise RuntimeError(
                    f"hsdp: unit {u.label} already ran under another root; run the model "
                    f"through its outermost fully_shard module")
            if u.overlap_outer != root.overlap_outer:
                raise ValueError("hsdp: overlap_outer must be the same for every unit of a model")
        comms = comm_groups(root.mesh)
        _agree_on_model(root, units, comms)
        self.outer = model_schedule(units)  # the outer modes' optimizer-step hooks
        self.ctx = ctx = RuntimeContext(
            root=root, units=units, groups=[g for u in units for g in u.groups], comms=comms,
            coll=root.collectives, streams=root.streams or Streams.for_device(root.device),
            ops=op_table(root.overlap_outer), step=Step(), outer=self.outer)
        self.gathering = Gathering(ctx)
        self.graphs = Graphs(ctx)
        self.recovery = Recovery(ctx, self.gathering, self.graphs)
        self.optim = OptimizerSteps(ctx, self.gathering, self.recovery, self.graphs)
        self.schedule = Schedule(ctx, self.gathering, self.recovery, self.optim, self.graphs)
        for u in units:
            u.runtime = self
        for g in ctx.groups:
            g.on_all_grads = self.schedule.reduce
        # What units, the public API, tools and tests read.
        self.root, self.step, self.log = root, ctx.step, ctx.step.log
        self.float8_groups = self.optim.float8_groups
        self.pre_forward = self.schedule.pre_forward
        self.post_forward = self.schedule.post_forward
        self.settle = self.recovery.settle
        self.refresh_float8_scales = self.optim.refresh_float8_scales
        self.stream_of = ctx.stream_of
        self.unshard = self.gathering.unshard  # explicit module.unshard()
        self.reshard = self.gathering.reshard  # explicit module.reshard()
        STEPPERS.add(self.optim)  # its hooks run at the steps of optimizers of this model

    @property
    def broken(self) -> str | None:
        """Why hsdp's communicators cannot be used any more (None: they can)."""
        return self.step.broken

    def synchronize(self) -> None:
        """Block until every stream is idle (state dict, teardown)."""
        self.settle()
        self.ctx.streams.drain()
        self.ctx.streams.compute.record().synchronize()
