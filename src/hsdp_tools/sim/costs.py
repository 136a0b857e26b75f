"""The cost model of ``hsdp sim``: seconds for every op of a recorded program.

- Model compute (a unit's ``FWD`` / ``BWD`` / ``RECOMPUTE`` phase): the op's FLOPs
  (torch's flop formulas: matmuls and attention) at ``tflops`` achieved. The phases' other
  ops take no time of their own: a calibrated ``tflops`` absorbs them. On the meta device
  attention runs as its math decomposition, whose two batched matmuls are counted in full
  (no causal saving), as the calibration counts them.
- Ops outside every unit's phases (the loss: softmax and its backward over the logits,
  0.5 ms a step at seq 1024 and 1.9 at seq 4096 in an 8B-layer trace): by their FLOPs
  likewise if they have any, else memory bound, bytes at ``mem_gbps`` (no phase's
  ``tflops`` would absorb them).
- The runtime's own compute (``COPY_IN``: gradients into the reduce-scatter input) and
  the optimizer (``OPTIMIZER``): memory bound, bytes read and written at ``mem_gbps``.
  These are the same ops on the meta device as on a GPU, and their cost follows the
  shard, not the FLOPs (hfsdp's optimizer works on 1/outer of hsdp's shard).
- Side-stream ops: their collectives' modelled time on the fabric (``hsdp_tools.sim.fabric``) plus
  their own tensor work (casts and copies into and out of the collective buffers: bytes
  at ``mem_gbps``; on one rank of an axis that is all there is), times
  ``comm_scale`` per kind (inner_ag / inner_rs / outer; a calibration's measured over
  modelled busy time: e.g. collectives slowed down by compute sharing the GPU).
  ``comm_wait`` per kind instead adds to each of its ops that runs a collective that
  many of the setup's mean FLOP kernels (``mean_kernel_seconds``; a machine profile's):
  a collective's kernel launched while a compute kernel holds every SM starts when that
  kernel's blocks retire, so the wait follows compute's kernel length (longer sequences,
  longer waits), not the link's transfer time (in emulated 16x8 runs, 0.09 ms per
  all-gather beside seq-1024 compute, 0.23 ms beside seq 4096).
  A side op's own tensor work competes with compute for the GPU's SMs: its share
  ``exclusive[kind]`` (default 1) runs between two compute ops and delays the next; the
  rest, and the collective itself, run beside compute (NCCL uses a few SMs; the
  emulation's sleep kernel one). In real traces a cast of a whole unit (0.7 ms, on one
  rank of an axis) runs alone and leaves a 0.7 ms gap on compute (share 0.7-1 at seq
  4096), while the small casts of a 1/8 shard mostly fit beside a running matmul
  (share 0.1-0.3); a calibration measures the share per kind.
  The fused quantization passes of the compressed outer reduction and gather
  (``quant_pricing``) count as such work: their bytes at ``mem_gbps`` times the pass's
  ``quant_x_floor`` (the kernels' measured time over the copy floor; 1 where unknown).
- Compute beside a collective kernel: a phase class's ``drag`` is the share of its
  compute's speed lost while one runs (NCCL's kernels hold SMs: in one real 2x1 trace a
  backward GEMM took 44 us alone and 200-280 us beside an all-reduce; a calibration
  measures it per class: 0.3-0.6 for the blocks' backward, 0.3 for their forward, on
  two H200s). The compute op is stretched for as long as they overlap.
- Host: ``host_us_per_op`` to issue each compute op; per side-stream op its class's
  ``side_host_us`` (``side_class``: "rs:FREE_GRAD", "ag:AG", ...: the eleven gradient
  releases at a step's start take 40 us each, a fifth of an all-gather's submit; a class
  without one: their mean) plus ``host_us_per_side_op`` (e.g. a calibration's host time
  of the hooks that issue them); everything else is free.
- ``peers``: the cost models of ranks 1, 2, ... where they differ from this one (rank
  0's): a calibration on a real run gives each rank its own host costs. A setup of that
  many ranks is then simulated with every rank at once (``Program.evaluate_ranks``: a
  collective starts when the last rank of its group is ready for it); others with this
  model alone, as every rank alike.
- ``class_tflops`` / ``class_host_us``: per phase class, its achieved TFLOP/s and host
  us per op (a machine profile's, ``hsdp_tools.sim.profile``: they transfer to other
  sequences, meshes and microbatch counts); classes without one use ``tflops`` /
  ``host_us_per_op``.
- ``phases``: measured costs per phase class (``phase_class``: "BWD:LlamaBlock", ...)
  and instance, e.g. from a traced ``bench step`` (``hsdp_tools.sim.calibrate``), valid for
  the setup they were measured on (``phases_key``). They replace the above for those
  phases, spread over the instance's ops: device time in proportion to FLOPs (else
  bytes, else evenly), host time evenly.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from hsdp_tools.report.metrics import Interval, op_kind
from hsdp_tools.sim.clock import Program, ProgramOp
from hsdp_tools.sim.fabric import Fabric

MEMORY_PHASES = ("COPY_IN", "OPTIMIZER")
# the models' causal attention as recorded, and the share of its counted FLOPs it does
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention",
                 "aten::_scaled_dot_product_flash_attention_backward")
CAUSAL_SHARE = 0.5
# the matmuls of the models' linears: float8 ones in a float8 setup (``Setup.float8``)
MATMUL_OPS = ("aten::mm", "aten::addmm")
Price = Callable[[ProgramOp], tuple[float, ...]]


def phase_kind(label: str) -> str:
    """"FWD:LlamaBlock7" -> "FWD"; "" (outside every phase) -> ""."""
    return label.split(":", 1)[0]


def phase_class(label: str) -> str:
    """A phase label without the runtime's unit numbers: "COPY_IN:LlamaBlock7/0" ->
    "COPY_IN:LlamaBlock/0" (every block of a model shares one class)."""
    return re.sub(r"(?<=[A-Za-z_])\d+(?=/|$)", "", label)


def side_class(stream: str, label: str) -> str:
    """A side op's class, for its host cost: ("rs", "FREE_GRAD:LlamaBlock3/0") ->
    "rs:FREE_GRAD"."""
    return f"{stream}:{label.split(':', 1)[0]}"


def work_flops(op: ProgramOp) -> float:
    """The FLOPs an op's kernel does: the counted ones, causal attention's at half (torch's
    formula counts every score; the models' attention is causal, and its kernel computes
    only the lower triangle)."""
    return op.payload.flops * (CAUSAL_SHARE if op.payload.name in ATTENTION_OPS else 1.0)


def memory_bound(op: ProgramOp) -> bool:
    """A compute op priced by its bytes (module doc): the runtime's own compute, the
    optimizer, and an op without FLOPs outside every phase."""
    kind = phase_kind(op.label)
    return kind in MEMORY_PHASES or not (kind or op.payload.flops)


@dataclass(frozen=True)
class PhaseCost:
    """Measured cost of one instance of a phase: host time to issue it, device time."""

    host_ms: float
    device_ms: float


@dataclass(frozen=True)
class CostModel:
    fabric: Fabric = field(default_factory=Fabric)
    tflops: float = 600.0
    mem_gbps: float = 3000.0
    host_us_per_op: float = 0.0
    host_us_per_side_op: float = 0.0
    side_host_us: dict[str, float] = field(default_factory=dict)  # per ``side_class``
    class_tflops: dict[str, float] = field(default_factory=dict)  # per ``phase_class``
    class_host_us: dict[str, float] = field(default_factory=dict)  # per ``phase_class``
    phases: dict[str, PhaseCost] = field(default_factory=dict)
    phases_key: str = ""  # the setup they were measured on (``Setup.phase_key``)
    comm_scale: dict[str, float] = field(default_factory=dict)
    comm_wait: dict[str, float] = field(default_factory=dict)  # per kind: mean kernels
    # Per side-op kind: the share of its own tensor work that holds the SMs (module doc).
    exclusive: dict[str, float] = field(default_factory=dict)
    # Per phase class: the share of its compute's speed lost beside a collective kernel.
    drag: dict[str, float] = field(default_factory=dict)
    peers: tuple[CostModel, ...] = ()  # ranks 1, 2, ... (module doc)
    # Float8 setups: how much faster their (float8) matmuls run than ``tflops`` says.
    float8_speedup: float = 1.0
    # per fused quantization pass (``quant_pricing``): its time over its bytes at mem_gbps
    quant_x_floor: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if min(self.tflops, self.mem_gbps, *self.class_tflops.values()) <= 0:
            raise ValueError("sim: tflops and mem_gbps must be > 0")
        if any(v <= 0 for v in self.comm_scale.values()):
            raise ValueError("sim: comm_scale factors must be > 0")
        if min(self.host_us_per_op, self.host_us_per_side_op, *self.side_host_us.values(),
               *self.class_host_us.values()) < 0:
            raise ValueError("sim: host costs must be >= 0")
        if any(not 0 <= v <= 1 for v in self.exclusive.values()):
            raise ValueError("sim: exclusive shares must be within [0, 1]")
        if any(not 0 <= v < 1 for v in self.drag.values()):
            raise ValueError("sim: drag shares must be within [0, 1)")
        if self.float8_speedup <= 0:
            raise ValueError("sim: float8_speedup must be > 0")

    def compute_seconds(self, op: ProgramOp) -> float:
        """An op's device time by the FLOP / bandwidth model."""
        if memory_bound(op):
            return op.payload.nbytes / (self.mem_gbps * 1e9)
        rate = self.class_tflops.get(phase_class(op.label), self.tflops)
        if op.payload.name in MATMUL_OPS:
            rate *= self.float8_speedup
        return work_flops(op) / (rate * 1e12)

    def mean_kernel_seconds(self, program: Program) -> float:
        """The mean device time of ``program``'s compute ops with FLOPs (the model's
        matmuls and attention), by the FLOP model."""
        times = [self.compute_seconds(op) for op in program.ops
                 if op.kind == "compute" and op.payload.flops > 0]
        return sum(times) / len(times) if times else 0.0

    def pricer(self, program: Program) -> Price:
        """``price(op) -> (host s, device s[, a side op's own tensor work s; a compute
        op's drag])`` for ``program``'s ops (``Program.evaluate``)."""
        shares = _Shares(program, self.phases) if self.phases else None
        host_op, host_side = self.host_us_per_op * 1e-6, self.host_us_per_side_op * 1e-6
        by_class = {c: us * 1e-6 for c, us in self.side_host_us.items()}
        kernel_s = self.mean_kernel_seconds(program) if self.comm_wait else 0.0
        unknown = sum(by_class.values()) / len(by_class) if by_class else 0.0

        def price(op: ProgramOp) -> tuple[float, ...]:
            if op.kind == "compute":
                cls = phase_class(op.label)
                drag = self.drag.get(cls, 0.0)
                measured = self.phases.get(cls) if shares else None
                if measured is None:
                    host = self.class_host_us.get(cls)
                    return (host_op if host is None else host * 1e-6,
                            self.compute_seconds(op), drag)
                host_share, device_share = shares.of(op)
                return (measured.host_ms * 1e-3 * host_share,
                        measured.device_ms * 1e-3 * device_share, drag)
            if op.kind == "side":
                kind = op_kind(Interval(op.stream, op.label, 0, 0))
                scale = self.comm_scale.get(kind, 1.0)
                local = scale * (op.local_bytes + sum(
                    n * self.quant_x_floor.get(k, 1.0) for k, n in op.kernel_bytes)
                ) / (self.mem_gbps * 1e9)
                host = host_side + by_class.get(side_class(op.stream, op.label), unknown)
                busy = scale * sum(self.fabric.seconds(*c) for c in op.payload) + local
                if op.payload:
                    busy = max(0.0, busy + self.comm_wait.get(kind, 0.0) * kernel_s)
                return host, busy, local * self.exclusive.get(kind, 1.0)
            return 0.0, 0.0

        return price


class _Shares:
    """Each compute op's share of its phase instance (host: evenly; device: by FLOPs, else
    bytes, else evenly)."""

    def __init__(self, program: Program, phases: dict[str, PhaseCost]) -> None:
        self.totals: dict[int, list[float]] = {}  # begin op -> [ops, flops, bytes]
        for op in program.ops:
            if op.kind == "compute" and op.phase >= 0:
                t = self.totals.setdefault(op.phase, [0, 0.0, 0])
                t[0] += 1
                t[1] += op.payload.flops
                t[2] += op.payload.nbytes

    def of(self, op: ProgramOp) -> tuple[float, float]:
        n, flops, nbytes = self.totals[op.phase]
        if flops > 0:
            return 1 / n, op.payload.flops / flops
        if nbytes > 0:
            return 1 / n, op.payload.nbytes / nbytes
        return 1 / n, 1 / n
