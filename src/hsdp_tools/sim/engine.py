"""Drive the runtime's own schedule on virtual streams and record what it issues.

A ``Setup`` is built as ``bench step`` builds it (each block a ``fully_shard`` unit, the
root last; AdamW; ``hsdp.microbatch`` over the microbatches), but on the meta device
(no memory, no compute) and torch's fake process group posing as rank 0 of the mesh.
The root unit gets virtual streams (``hsdp_tools.sim.clock.VirtualBackend``) and collectives
that report their sizes (``RecordedCollectives``), and every op issued on compute is
added to the program with its FLOPs and bytes (a dispatch mode). One warm-up step (it
records the unit order and creates the optimizer state), then the measured step;
``evaluate`` prices and times it (``hsdp_tools.sim.costs``): as every rank alike, or, with a
cost model per rank (a calibration on a real run), every rank at once on the same
program.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import flop_registry

import hsdp
from hsdp.runtime.diloco import DiLoCo
from hsdp.runtime.outer_modes import parse_mode
from hsdp.sharding.comm import Collectives
from hsdp.sharding.policy import Strategy
from hsdp.topology.mesh_dims import axis_groups
from hsdp_tools.models import LlamaConfig, ModelConfig, lm_loss
from hsdp_tools.models_moe import MoEConfig
from hsdp_tools.moe_placement import unit_meshes
from hsdp_tools.report.args import DTYPES
from hsdp_tools.report.metrics import Interval, step_metrics
from hsdp_tools.sim.clock import Program, virtual_streams
from hsdp_tools.sim.costs import CostModel
from hsdp_tools.sim.ep_pricing import ep_pricer, expert_names, sim_model
from hsdp_tools.sim.fabric import Link
from hsdp_tools.sim.quant_pricing import fused_passes
from hsdp_tools.sim.tp_pricing import tp_pricer


@dataclass(frozen=True)
class Setup:
    """One configuration to simulate (what ``bench step`` would run)."""

    model: ModelConfig
    outer: int
    inner: int
    strategy: str = "hsdp"
    overlap_outer: bool = True
    microbatches: int = 1
    mbs: int = 1
    dtype: str = "bf16"
    reduce_dtype: str = "fp32"
    device: str = "meta"  # where the model is built (meta: no memory, no compute)
    # tensor parallelism: tp ranks per data-parallel rank, TP collectives on a link of
    # tp_gbps bus GB/s (and the fabric's inner latency); see hsdp_tools.sim.tp_pricing
    tp: int = 1
    tp_gbps: float = 370.0
    float8: bool = False  # torchao float8 linears (tensorwise), float8 all-gather on
    outer_reduce: str = "none"  # the compressed outer reduction: "int8", "fp8_e4m3[:block]"
    outer_gather: str = "none"  # hfsdp's compressed outer parameter all-gather: the same forms
    # init_mesh's outer_sync: "none" or "diloco:inner_steps=50,fragments=4,..." (the
    # steps of a period: see ``period_steps``)
    outer_sync: str = "none"

    def __post_init__(self) -> None:
        Strategy.parse(self.strategy)
        parse_mode("outer_reduce", self.outer_reduce)  # raises on a bad one
        if parse_mode("outer_gather", self.outer_gather) is not None and self.strategy != "hfsdp":
            raise ValueError(f"sim: outer_gather={self.outer_gather!r} needs strategy "
                             f"'hfsdp' (hsdp has no outer all-gather of parameters)")
        sync = parse_mode("outer_sync", self.outer_sync)
        period_steps(sync)  # raises on a delay it cannot time
        if sync is not None and self.units() % sync.fragments:
            n, layers = self.units(), self.model.layers
            experts = f", {layers} expert units" if n > layers + 3 else ""
            raise ValueError(
                f"sim: DiLoCo fragments={sync.fragments} does not divide the model's {n} "
                f"fully_shard units (the embedding, {layers} blocks{experts}, the head and "
                f"the root); choose fragments among {[d for d in range(1, n + 1) if n % d == 0]}"
                f" or another number of layers")
        if min(self.outer, self.inner, self.microbatches, self.mbs) < 1:
            raise ValueError("sim: outer, inner, microbatches and mbs must be >= 1")
        if self.tp < 1 or (self.tp > 1 and not isinstance(self.model, LlamaConfig)):
            raise ValueError(f"sim: tp={self.tp}: tp must be >= 1, and tp > 1 needs a llama "
                             f"model (the TP plan of hsdp_tools.sim.tp_pricing)")
        if isinstance(self.model, MoEConfig) and (self.tp > 1 or self.inner % self.model.ep):
            raise ValueError(f"sim: an MoE model needs tp 1 and an ep ({self.model.ep}) "
                             f"dividing inner ({self.inner})")
        if self.float8 and self.tp > 1:
            raise ValueError("sim: float8 with tp > 1 is not modelled "
                             "(hsdp_tools.sim.tp_pricing prices "
                             "bf16 TP collectives); simulate them apart")
        for d in (self.dtype, self.reduce_dtype):
            if d not in DTYPES:
                raise ValueError(f"sim: unknown dtype {d!r}; known: {', '.join(DTYPES)}")

    def units(self) -> int:
        """How many ``fully_shard`` units ``shard`` makes of the model: the embedding, each
        block (and each block's experts, with expert parallelism), the head and the root."""
        experts = isinstance(self.model, MoEConfig) and self.model.ep > 1
        return self.model.layers * (2 if experts else 1) + 3

    def phase_key(self) -> str:
        """What measured phase costs depend on: model, micro-batch size, dtypes."""
        return json.dumps([dataclasses.asdict(self.model), self.mbs, self.dtype,
                           self.reduce_dtype] + ([self.tp] if self.tp > 1 else [])
                          + (["float8"] if self.float8 else []))


@dataclass(frozen=True)
class OpCost:
    """What a compute op costs, as the cost model sees it."""

    name: str
    flops: float
    nbytes: int


@dataclass
class Recording:
    """The program of a warm-up step and the measured step (from op ``start`` on), and
    stable names for the runtime's unit labels (``shard``)."""

    setup: Setup
    program: Program
    start: int
    names: dict[str, str]
    # the op index after each measured run of steps (``period_steps``), how many times it
    # counts in a period and its steps
    ends: list[int] = dataclasses.field(default_factory=list)
    weights: list[int] = dataclasses.field(default_factory=list)
    steps: list[int] = dataclasses.field(default_factory=list)


class RecordedCollectives(Collectives):
    """hsdp's collectives that also report each one's sizes to ``program``
    (``Program.collective``): the virtual clock times them later."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program

    def before(self, kind: str, axis: str, nbytes: int, group_size: int) -> None:
        self.program.collective(kind, axis, nbytes, group_size)


class _IssueCompute(TorchDispatchMode):
    """Adds every kernel-launching op issued on compute to the program. Views and empty
    tensors launch nothing; ops inside a side stream's closure belong to that stream's op (its
memory-bound local work, e.g. casts); ops on
    tensor subclasses (DTensor) are counted as the local ops they run.

    Under a dispatch mode, in-place foreach ops (the optimizer's) leave the version
    counters of the tensors they write unchanged; the runtime detects optimizer updates
    by them (hfsdp's outer all-gather), so a write that did not bump one bumps it here.

    Speed: meta kernels are mostly Python; a functional op (no aliasing, no in-place
    write) on meta tensors is a pure function of its arguments' shapes, strides, dtypes
    and scalars, so its outputs' metadata and cost are kept per such key (``_MEMO``, for
    the process) and later calls (the next block's identical op, the next recording's)
    make empty meta outputs instead.
    """

    MEMO = True

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) or t.__module__.startswith("torchao.") for t in types):
            # the optimizer's DTensors, torchao's float8 tensors (--float8): counted as
            # their local ops (an emulated float8 matmul: its high-precision mm)
            return NotImplemented
        if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types):
            return func(*args, **kwargs)  # e.g. DTensor's fake-tensor sharding propagation
        key = _memo_key(func, args, kwargs) if self.MEMO else None
        if key is not None and key in _MEMO:
            template, cost = _MEMO[key]
            out = _from_template(template)
        else:
            written = _written(func, args, kwargs)
            versions = [t._version for t in written]
            out = func(*args, **kwargs)
            for t, v in zip(written, versions):
                if t._version == v:
                    torch.autograd.graph.increment_version(t)
            formula = flop_registry.get(func._overloadpacket)
            flops = formula(*args, **kwargs, out_val=out) if formula else 0
            nbytes = sum(t.numel() * t.element_size()
                         for t in _tensors((args, tuple(kwargs.values()), out)))
            cost = OpCost(str(func.name()), float(flops), nbytes)
            template = _template(out) if key is not None else None
            if template is not None:
                _MEMO[key] = (template, cost)
        if func.is_view or func in _NO_KERNEL or func.namespace in _COMM_NAMESPACES:
            return out
        if self.program.issuing_side_op:
            self.program.local(cost.nbytes)  # a cast / copy on the side stream
        else:
            self.program.compute(cost)
        return out


# Allocation without a kernel (also what DTensor's sharding propagation makes, uncached).
_NO_KERNEL = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten.empty_like.default}


_COMM_NAMESPACES = ("c10d", "_c10d_functional")  # collectives: priced by the fabric
_MEMO: dict[tuple, tuple[Any, OpCost]] = {}  # see _IssueCompute
_FUNCTIONAL: dict = {}  # op -> True if it neither aliases nor writes any argument


def _memo_key(func, args: tuple, kwargs: dict) -> tuple | None:
    """A hashable description of a functional op's call on meta tensors, else None."""
    if func not in _FUNCTIONAL:
        schema = func._schema
        _FUNCTIONAL[func] = not any(a.alias_info is not None
                                    for a in (*schema.arguments, *schema.returns))
    if not _FUNCTIONAL[func]:
        return None
    try:
        key = (func, _describe(args), _describe(tuple(sorted(kwargs.items()))))
        hash(key)
    except (TypeError, _NotMeta):
        return None
    return key


class _NotMeta(Exception):
    pass


def _describe(value):
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _NotMeta
        return ("T", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return value


def _template(out) -> tuple | None:
    """The metadata of a memoizable output (meta tensors, or a tuple / list of meta
    tensors and Nones; the outer tuple says which), else None."""
    items = out if isinstance(out, (list, tuple)) else [out]
    if not all(o is None or (isinstance(o, torch.Tensor) and o.is_meta) for o in items):
        return None
    meta = [None if o is None else (tuple(o.shape), o.stride(), o.dtype) for o in items]
    return (type(out) if isinstance(out, (list, tuple)) else None, meta)


def _from_template(template: tuple):
    kind, meta = template
    with _disable_current_modes():  # making the outputs is not an op of the program
        outs = [None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2],
                                                           device="meta") for m in meta]
    return outs[0] if kind is None else kind(outs)


def _tensors(value) -> Iterator[torch.Tensor]:
    """The tensors in ``value``: a tensor, or nested lists / tuples (op arguments)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


_WRITES: dict = {}  # op -> [(position, name)] of the arguments it writes in place


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (``Tensor(a!)`` arguments of its schema)."""
    if func not in _WRITES:
        _WRITES[func] = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                         if a.alias_info is not None and a.alias_info.is_write]
    out: list[torch.Tensor] = []
    for i, name in _WRITES[func]:
        out += _tensors(args[i] if i < len(args) else kwargs.get(name))
    return out


@contextmanager
def fake_world(world: int) -> Iterator[None]:
    """torch's fake process group of ``world`` ranks (this process is rank 0), unless one of
    that size is already up (then it is left as it is)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_backend() != "fake":
            raise RuntimeError(f"hsdp sim: needs torch's fake process group of {world} ranks; "
                               f"a {dist.get_backend()} group of {dist.get_world_size()} is up")
        yield
        return
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard(model: torch.nn.Module, mesh: DeviceMesh, setup: Setup,
          mp: hsdp.MixedPrecision) -> dict[str, str]:
    """``fully_shard`` ``model``'s units (``shard_units``, as ``bench step``) and its root
    with ``setup``'s strategy; returns stable names for the units' labels (the root: the
    model class; Embed, Block<i>, Head)."""
    kw = dict(strategy=setup.strategy, mp_policy=mp, overlap_outer=setup.overlap_outer,
              outer_reduce=parse_mode("outer_reduce", setup.outer_reduce),
              outer_gather=parse_mode("outer_gather", setup.outer_gather))
    for unit, reshard, unit_mesh in unit_meshes(model, mesh):  # an MoE's experts on theirs
        hsdp.fully_shard(unit, mesh=unit_mesh, reshard_after_forward=reshard, **kw)
    hsdp.fully_shard(model, mesh=mesh, **kw)
    return {model._hsdp_unit.label: type(model).__name__,
            model.embed._hsdp_unit.label: "Embed", model.head._hsdp_unit.label: "Head"} | {
        b._hsdp_unit.label: f"Block{i}" for i, b in enumerate(model.blocks)} | expert_names(
        model)


def period_steps(sync: DiLoCo | None) -> list[tuple[int | None, int, int]]:
    """What a period is timed by, as runs of steps (first step of the period, 1..H; steps
    run back to back, every stream idle only after the last; how many times the run counts
    in a period). Synchronous: one step. DiLoCo: for each step after which some fragment
    synchronizes, that step and the ``delay`` steps its all-reduce overlaps (the last one
    applies it); one step without a sync for the others."""
    if sync is None:
        return [(None, 1, 1)]
    h, run = sync.inner_steps, sync.delay + 1
    syncs = sorted({sync.offset(f) or h for f in range(sync.fragments)})
    busy = {(s + i - 1) % h + 1 for s in syncs for i in range(run)}
    if len(busy) < len(syncs) * run:
        raise ValueError(f"sim: DiLoCo delay={sync.delay} overlaps the next fragment's sync "
                         f"(inner_steps={h}, fragments={sync.fragments}): not modelled")
    quiet = [s for s in range(1, h + 1) if s not in busy]
    return [(s, run, 1) for s in syncs] + ([(quiet[0], 1, len(quiet))] if quiet else [])


def _set_period_step(model: torch.nn.Module, step: int | None) -> None:
    """Make the next optimizer step the ``step``-th of its DiLoCo period."""
    if step is not None:
        for g in model._hsdp_unit.runtime.outer.groups:
            g.anchor.steps = step - 1


def record(setup: Setup) -> Recording:
    """Run a warm-up step and the measured steps of ``setup`` on virtual streams (one;
    with DiLoCo each of ``period_steps``)."""
    cfg = setup.model
    outer_sync = parse_mode("outer_sync", setup.outer_sync)
    with fake_world(setup.outer * setup.inner):
        mesh = hsdp.init_mesh(setup.outer, setup.inner, "cpu", outer_sync=outer_sync)
        with torch.device(setup.device):
            model = sim_model(cfg, mesh)
        if setup.float8:
            model = _float8(model)
        mp = hsdp.MixedPrecision(DTYPES[setup.dtype], DTYPES[setup.reduce_dtype])
        names = shard(model, mesh, setup, mp)
        root = model._hsdp_unit
        root.streams, program = virtual_streams()
        root.collectives = RecordedCollectives(program)
        if setup.float8:  # meta weights have no scales until computed
            hsdp.precompute_float8_scales(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        tokens = torch.zeros(setup.mbs, cfg.seq, dtype=torch.long, device=setup.device)
        rec = Recording(setup, program, 0, names)
        with _IssueCompute(program), fused_passes(program):
            train_step(model, opt, tokens, 1)
            rec.start = len(program.ops)
            for step, steps, weight in period_steps(outer_sync):
                _set_period_step(model, step)
                for i in range(steps):
                    train_step(model, opt, tokens, setup.microbatches, drain=i == steps - 1)
                rec.ends.append(len(program.ops))
                rec.weights.append(weight)
                rec.steps.append(steps)
    return rec


def _float8(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s linears in torchao float8 (emulated: meta and CPU have no float8
    matmul) with float8 all-gather, as ``bench step --float8`` converts them."""
    from hsdp.float8 import INSTALL, convert_to_float8

    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as exc:
        raise ImportError(f"hsdp sim --float8 needs torchao: {INSTALL}") from exc

    return convert_to_float8(model, Float8LinearConfig(enable_fsdp_float8_all_gather=True,
                                                       emulate=True))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor,
               microbatches: int, drain: bool = True) -> None:
    """A training step as ``bench step`` times it: until every stream is idle (unless not
    ``drain``)."""
    for m in range(microbatches):
        with hsdp.microbatch(model, is_last=m == microbatches - 1):
            (lm_loss(model(tokens), tokens) / microbatches).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if drain:
        hsdp.synchronize(model)


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class SimResult:
    """The measured step on the virtual clock: ``intervals`` (us from the step's start;
    side ops, FREE included, and compute by phase), their ``step_metrics`` plus
    ``host_busy_ms``, and the step time (start to every stream idle, as ``bench step``)."""

    intervals: list[Interval]
    metrics: dict
    t_step_ms: float  # DiLoCo: the mean over a period (``period_steps``)


def evaluate(rec: Recording, costs: CostModel) -> SimResult:
    """Price and time ``rec``'s measured step (measured phase costs only if they were
    measured on this setup's model). With ``costs.peers`` for every other rank of the
    setup's mesh, the ranks run together, meeting at a host barrier before the step (as
    ``bench step``'s); the intervals and host time are rank 0's, the step lasts until the
    last rank's streams are idle."""
    setup = rec.setup
    world = setup.outer * setup.inner
    ranks = [costs, *costs.peers] if len(costs.peers) == world - 1 else [costs]
    prices = [_for_setup(c, setup).pricer(rec.program) for c in ranks]
    if setup.tp > 1:
        prices = [tp_pricer(p, rec.program, setup.model, setup.mbs,
                            DTYPES[setup.dtype].itemsize, setup.tp,
                            Link(setup.tp_gbps, c.fabric.inner.latency_us))
                  for p, c in zip(prices, ranks)]
    if isinstance(setup.model, MoEConfig) and setup.model.ep > 1:
        prices = [ep_pricer(p, rec.program, setup.model, setup.mbs,
                            DTYPES[setup.dtype].itemsize, c.fabric.inner)
                  for p, c in zip(prices, ranks)]
    if len(prices) == 1:
        timings = [rec.program.evaluate(prices[0], rec.start, shared_sms=True)]
    else:
        timings = rec.program.evaluate_ranks(prices, axis_groups(setup.outer, setup.inner),
                                             rec.start, shared_sms=True, barrier=rec.start)
    timing = timings[0]
    # from the host barrier (else rank 0's synchronize) to every rank's streams idle
    t0 = max(t.end_s[rec.start - 1] for t in timings)
    t1 = max(t.end_s[-1] for t in timings)
    ends = [t0] + [max(t.end_s[e - 1] for t in timings) for e in rec.ends]
    period_s = sum(w * (b - a) for w, a, b in zip(rec.weights, ends, ends[1:]))
    units = "|".join(re.escape(k) for k in sorted(rec.names, key=len, reverse=True))
    pattern = re.compile(f"(?<=:)({units})(?=/|$)")

    def name(label: str) -> str:
        return pattern.sub(lambda m: rec.names[m.group(0)], label)

    intervals = [Interval(r.stream, name(r.label), (r.start_s - t0) * 1e6,
                          (r.end_s - t0) * 1e6)
                 for r in timing.records
                 if r.stream != "compute" or not r.label.startswith(("wait:", "begin:", "end:"))]
    metrics = step_metrics(intervals, (0.0, (t1 - t0) * 1e6))
    metrics["host_busy_ms"] = timing.host_busy_s * 1e3
    steps = sum(w * n for w, n in zip(rec.weights, rec.steps))
    metrics["outer_bytes_per_step"] = _outer_bytes(rec) / steps
    if len(rec.ends) > 1:  # the recorded runs of a DiLoCo period, each
        metrics["period_runs_ms"] = [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]
    return SimResult(intervals, metrics, period_s * 1e3 / steps)


def _outer_bytes(rec: Recording) -> float:
    """The outer collectives' bytes per rank over a period (the recorded steps weighted)."""
    total, begin = 0.0, rec.start
    for end, weight in zip(rec.ends, rec.weights):
        total += weight * sum(n for op in rec.program.ops[begin:end] if op.kind == "side"
                              for _, axis, n, size in op.payload if axis == "outer" and size > 1)
        begin = end
    return total


def _for_setup(costs: CostModel, setup: Setup) -> CostModel:
    """``costs`` without measured phase costs unless they were measured on ``setup``'s
    model."""
    if costs.phases and costs.phases_key != setup.phase_key():
        return dataclasses.replace(costs, phases={}, phases_key="")
    return costs


def simulate(setup: Setup, costs: CostModel) -> SimResult:
    """Record ``setup``'s step and time it with ``costs``."""
    return evaluate(record(setup), costs)
