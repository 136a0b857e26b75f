"""A machine profile: what one ``bench step`` run (and ``bench collectives`` on the same
machine) says about the machine, in a few kilobytes of JSON, and the cost model it gives
for any other setup.

``hsdp sim calibrate`` writes it (``calibrate_profile``): the run is calibrated as
``hsdp_tools.sim.calibrate`` does (its traces' saved phases, host marks and side-op times),
then each measured phase class is turned from a time per instance of that run's setup
into a rate that transfers: its achieved TFLOP/s (the simulator's FLOPs of an instance
over its device time) and its host us per op (host time of an instance over the ops the
runtime issues in it), so that another sequence, mesh or microbatch count is priced by
its own FLOPs and op counts. Kept as measured: the memory bandwidth (optimizer, copy-in,
the side ops' casts), the host cost of each side-op class and of the hooks that issue
them, per phase class the drag beside collective kernels, per collective kind the share
of its casts that holds compute up, per collective kind the time an op takes beyond its
modelled transfer and casts in units of the setup's mean compute kernel
(``CostModel.comm_wait``: the calibrated busy time less the modelled one, per op; on
real NCCL the transfer is modelled on the links measured by ``bench collectives``), and
the links themselves.

A prediction (``MachineProfile.cost_model``) uses the profile and the setup only: model,
mesh, sequence, microbatches, dtypes, and the fabric (an emulated run's, a sweep's, or
the profile's measured links).
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

from hsdp_tools.report.metrics import Interval, op_kind
from hsdp_tools.sim.calibrate import calibrate, fabric_of, setup_from_results
from hsdp_tools.sim.costs import MEMORY_PHASES, CostModel, phase_class, phase_kind, work_flops
from hsdp_tools.sim.engine import Recording, evaluate, record
from hsdp_tools.sim.fabric import Fabric, Link, fit_collectives

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class MachineProfile:
    """One machine's calibration (module doc); ``sources``: the runs it was made from
    (``step``: the ``bench step`` JSON, ``collectives``: ``bench collectives`` JSONs), as
    given, which a held-out comparison must not predict."""

    machine: str
    gpu: str
    sources: dict[str, list[str]]
    tflops: float  # classes without a rate of their own
    class_tflops: dict[str, float]
    host_us_per_op: float  # classes without a host cost of their own
    class_host_us: dict[str, float]
    mem_gbps: float
    host_us_per_side_op: float
    side_host_us: dict[str, float]
    drag: dict[str, float]
    exclusive: dict[str, float]
    comm_wait: dict[str, float]
    links: dict[str, dict[str, float]]  # axis -> Link fields; {} on an emulated machine
    # per fused quantization pass: time over the copy floor (``quant_pricing``; a
    # ``bench quant`` JSON's); {}: at the copy floor
    quant_x_floor: dict[str, float] = dataclasses.field(default_factory=dict)

    def fabric(self, default: Fabric) -> Fabric:
        """``default`` with the profile's measured links in place of its own."""
        return Fabric(*(Link(**self.links[axis]) if axis in self.links
                        else getattr(default, axis) for axis in ("inner", "outer")))

    def cost_model(self, fabric: Fabric) -> CostModel:
        """The cost model of this machine over ``fabric`` (module doc)."""
        return CostModel(fabric, self.tflops, self.mem_gbps, self.host_us_per_op,
                         self.host_us_per_side_op, dict(self.side_host_us),
                         class_tflops=dict(self.class_tflops),
                         class_host_us=dict(self.class_host_us),
                         comm_wait=dict(self.comm_wait),
                         exclusive=dict(self.exclusive),
                         drag=dict(self.drag), quant_x_floor=dict(self.quant_x_floor))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"format": FORMAT, **dataclasses.asdict(self)},
                                         indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> MachineProfile:
        data = json.loads(Path(path).read_text())
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"{path}: not a machine profile of format {FORMAT} "
                             f"(write one with `hsdp sim calibrate`)")
        return cls(**data)


def calibrate_profile(step: str | Path, collectives: list[str | Path] = (),
                      machine: str = "", schedule: str = "overlap") -> MachineProfile:
    """The profile of the machine that ran ``step`` (a ``bench step`` JSON; its overlapped
    schedule unless ``schedule``), its links from ``collectives`` (``bench collectives``
    JSONs of the same machine; needed for a run on real NCCL, whose collectives then
    calibrate against them)."""
    data = json.loads(Path(step).read_text())
    links: dict[str, Link] = {}
    for path in collectives:
        links |= fit_collectives(json.loads(Path(path).read_text()))
    emulated = data["meta"].get("emulate", True)
    if not emulated and not links:
        raise ValueError(f"{step}: a run on real NCCL calibrates against the machine's "
                         f"links: pass its `bench collectives` JSONs")
    base = Fabric(*(links.get(axis, getattr(Fabric(), axis)) for axis in ("inner", "outer")))
    costs = calibrate(step, CostModel(fabric=fabric_of(data["meta"], base)), schedule)
    rec = record(setup_from_results(data, schedule))
    per_class: dict[str, list] = defaultdict(lambda: [set(), 0, 0.0])  # instances, ops, flops
    for op in rec.program.ops[rec.start:]:
        if op.kind == "compute" and op.phase >= 0:
            c = per_class[phase_class(op.label)]
            c[0].add(op.phase)
            c[1] += 1
            c[2] += work_flops(op)
    class_tflops, class_host_us = {}, {}
    for cls, cost in costs.phases.items():
        if cls not in per_class:
            continue
        instances, ops, flops = per_class[cls]
        n = len(instances)
        class_host_us[cls] = cost.host_ms * 1e3 * n / ops
        if flops > 0 and cost.device_ms > 0 and phase_kind(cls) not in MEMORY_PHASES:
            class_tflops[cls] = flops / n / (cost.device_ms * 1e9)
    return MachineProfile(
        machine=machine, gpu=(data["meta"].get("hardware") or {}).get("gpu", ""),
        sources={"step": [str(step)], "collectives": [str(p) for p in collectives]},
        tflops=costs.tflops, class_tflops=class_tflops,
        host_us_per_op=costs.host_us_per_op, class_host_us=class_host_us,
        mem_gbps=costs.mem_gbps, host_us_per_side_op=costs.host_us_per_side_op,
        side_host_us=dict(costs.side_host_us), drag=dict(costs.drag),
        exclusive=dict(costs.exclusive), comm_wait=comm_wait(rec, costs, class_tflops),
        links={axis: dataclasses.asdict(link) for axis, link in links.items()})


def comm_wait(rec: Recording, costs: CostModel,
              class_tflops: dict[str, float]) -> dict[str, float]:
    """Per collective kind, the busy time ``costs`` (a calibration) gives its ops beyond
    the modelled one (``comm_scale`` 1), per op that runs a collective, in mean compute
    kernels (priced at ``class_tflops``, as the profile prices them)."""
    plain = dataclasses.replace(costs, comm_scale={}, peers=())
    kernel_s = dataclasses.replace(plain, phases={}, class_tflops=class_tflops
                                   ).mean_kernel_seconds(rec.program)
    modelled = evaluate(rec, plain).metrics["busy_ms"]["by_kind"]
    ops: dict[str, int] = defaultdict(int)
    for op in rec.program.ops[rec.start:]:
        if op.kind == "side" and op.payload:
            ops[op_kind(Interval(op.stream, op.label, 0, 0))] += 1
    return {kind: (scale - 1.0) * modelled[kind] * 1e-3 / ops[kind] / kernel_s
            for kind, scale in costs.comm_scale.items() if ops.get(kind) and kernel_s > 0}


def same_run(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name the same run's JSON."""
    return Path(a).resolve() == Path(b).resolve()


def held_out(profile: MachineProfile, runs: list[str | Path]) -> None:
    """Raise ValueError if any of ``runs`` is one ``profile`` was made from: a prediction
    must not be checked against the run it was calibrated on."""
    made_from = profile.sources["step"] + profile.sources["collectives"]
    both = [str(r) for r in runs if any(same_run(r, s) for s in made_from)]
    if both:
        raise ValueError(f"the profile was calibrated on {', '.join(both)}: predict only "
                         f"runs it was not made from (held out)")
