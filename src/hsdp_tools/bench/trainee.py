"""The step bench's trainees: one model + optimizer per schedule, stepped the same way.

Schedules (same mesh, same seed, same synthetic tokens; each block is a unit, the root last):

- ``overlap``: hsdp, outer all-reduce on its own stream (``overlap_outer=True``);
- ``serial``: hsdp, outer all-reduce on the rs stream (the baseline of docs/design.md);
- ``hfsdp`` / ``hfsdp-serial``: the same with strategy hfsdp;
- ``overlap-graph`` / ``serial-graph`` / ``hfsdp-graph`` / ``hfsdp-serial-graph``: the
  same hsdp schedules with forward + backward and the optimizer step captured in CUDA
  graphs after the first step and replayed (``hsdp_tools.bench.graphed``);
- ``overlap-q`` / ``hfsdp-q``: ``overlap`` / ``hfsdp`` with the compressed outer reduction
  (``fully_shard(outer_reduce=...)``: ``--outer-reduce``, default int8);
- ``hfsdp-g`` / ``hfsdp-qg``: ``hfsdp`` / ``hfsdp-q`` with the compressed outer parameter
  all-gather (``fully_shard(outer_gather=...)``: ``--outer-gather``, default int8);
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on the same 2-D mesh (HSDP);
- ``mfsdp``: Megatron-FSDP as HSDP on the same ranks (``hsdp_tools.bench.mfsdp``; optional).

With tensor parallelism (a 3-D mesh) every schedule's model first gets torch's TP plan on
``mesh["tp"]`` (``hsdp_tools.bench.tp_plan``); hsdp shards on the 3-D mesh, FSDP2 on
``mesh["outer", "inner"]``, as torchtitan does; the TP collectives are counted and, under
emulation, delayed on the compute stream (``hsdp_tools.bench.tp_plan.tp_collectives``).

Every trainee uses torch AdamW (foreach) on what its library hands the optimizer. The
``unsharded`` reference (not a schedule) is the same layers unsharded in the parameter
dtype plus AdamW over one rank's shard of every parameter (fp32, one tensor per parameter):
the work of a step without any communication or sharding machinery.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import hsdp
from hsdp.float8 import convert_to_float8
from hsdp.sharding.comm import Collectives
from hsdp.sharding.tp_blocks import local_of
from hsdp.streams.contract import Tracer
from hsdp_tools.bench.emulate import DelayedCollectives, SleepClock, emulate
from hsdp_tools.bench.fsdp2 import fsdp2_collectives, shard_fsdp2
from hsdp_tools.bench.graphed import EAGER_STEPS, GraphedSteps
from hsdp_tools.bench.mfsdp import shard_mfsdp
from hsdp_tools.bench.tp_plan import apply_llama_tp_plan, tp_collectives
from hsdp_tools.models import ModelConfig, lm_loss
from hsdp_tools.moe_exchange import EPExchange
from hsdp_tools.moe_placement import build_bench_model, shard_divisors, unit_meshes
from hsdp_tools.sim.fabric import Fabric


@dataclass(frozen=True)
class BenchSchedule:
    """``library``: "hsdp", "fsdp2" or "mfsdp"; hsdp's strategy and overlap_outer."""

    library: str
    strategy: str | None = None
    overlap: bool | None = None
    compressed: bool = False  # hsdp's outer_reduce
    compressed_gather: bool = False  # hsdp's outer_gather (hfsdp)
    graphs: bool = False  # forward + backward and the optimizer step replayed as CUDA graphs


SCHEDULES: dict[str, BenchSchedule] = {
    "overlap": BenchSchedule("hsdp", "hsdp", True),
    "serial": BenchSchedule("hsdp", "hsdp", False),
    "hfsdp": BenchSchedule("hsdp", "hfsdp", True),
    "hfsdp-serial": BenchSchedule("hsdp", "hfsdp", False),
    "overlap-graph": BenchSchedule("hsdp", "hsdp", True, graphs=True),
    "serial-graph": BenchSchedule("hsdp", "hsdp", False, graphs=True),
    "hfsdp-graph": BenchSchedule("hsdp", "hfsdp", True, graphs=True),
    "hfsdp-serial-graph": BenchSchedule("hsdp", "hfsdp", False, graphs=True),
    "overlap-q": BenchSchedule("hsdp", "hsdp", True, True),
    "hfsdp-q": BenchSchedule("hsdp", "hfsdp", True, True),
    "hfsdp-g": BenchSchedule("hsdp", "hfsdp", True, compressed_gather=True),
    "hfsdp-qg": BenchSchedule("hsdp", "hfsdp", True, True, compressed_gather=True),
    "fsdp2": BenchSchedule("fsdp2"), "mfsdp": BenchSchedule("mfsdp")}
PEERS = ("fsdp2", "mfsdp")
PHASES = ("forward", "backward", "optimizer")
LR = 1e-4


def _no_mark(phase: str) -> None:
    pass


@dataclass
class Trainee:
    """One schedule's model and optimizer on this rank, and what was measured of it.

    ``comm(delays)`` wraps each step (the peers' collective interception; ``delays=False``:
    emulated collectives take no time); ``microbatch(is_last)`` wraps each microbatch;
    ``update()`` is the optimizer step and clearing of gradients; ``drain()`` returns once
    every stream of the schedule is idle."""

    name: str
    model: nn.Module
    tracer: Tracer
    comm: Callable[[bool], AbstractContextManager]
    microbatch: Callable[[bool], AbstractContextManager]
    update: Callable[[], None]
    drain: Callable[[], None]
    calibration_error: float | None = None
    samples_ms: list[float] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)
    free_ms: list[float] = field(default_factory=list)
    resident_bytes: int = 0
    peak_bytes: int = 0
    alloc_retries: list[int] = field(default_factory=list)  # per timed step (GPU)
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)
    # per recorded step (unprofiled, tracer on): ``trace.host_marks``, ``Tracer.side_ms``,
    # ``Tracer.device_marks``
    host_marks: list[list[list]] = field(default_factory=list)
    side_ms: list[list[list]] = field(default_factory=list)
    device_marks: list[list[list]] = field(default_factory=list)
    # bytes of the collectives issued so far ("<kind>:<axis>"; hsdp and FSDP2) and steps
    collective_bytes: dict[str, int] = field(default_factory=dict)
    steps_run: int = 0
    graphed: GraphedSteps | None = None  # CUDA graph replay after the first (eager) step
    run_ms: float | None = None  # per step, steps back to back (``run``; slowest rank)

    def step(self, batches: list[torch.Tensor], delays: bool = True,
             mark: Callable[[str], None] = _no_mark) -> float:
        """One optimizer step over all microbatches, returning once every stream is idle.
        ``mark(phase)`` is called at the end of each phase of ``PHASES`` (once per
        microbatch for forward and backward). Returns the host time (s) spent issuing the
        step: until the optimizer step and clearing of gradients returned, before waiting
        for the device. A graphed trainee replays its graphs after ``EAGER_STEPS``."""
        if self.graphed is not None and self.steps_run >= EAGER_STEPS:
            host = self.graphed.step(self, batches, delays, mark)
            self.steps_run += 1
            return host
        t0 = time.perf_counter()
        with self.comm(delays):
            self.forward_backward(batches, mark)
            self.update()
            mark("optimizer")
            host = time.perf_counter() - t0
            self.drain()
        self.steps_run += 1
        return host

    def run(self, batches: list[torch.Tensor], steps: int) -> None:
        """``steps`` eager steps back to back, every stream drained once at the end: what
        one step leaves running on a side stream (hfsdp's outer all-gather after the
        optimizer step) overlaps the next step's forward, as in a training loop."""
        with self.comm(True):
            for _ in range(steps):
                self.forward_backward(batches)
                self.update()
            self.drain()
        self.steps_run += steps

    def forward_backward(self, batches: list[torch.Tensor],
                         mark: Callable[[str], None] = _no_mark) -> None:
        """Forward and backward of every microbatch (the outer reduction on the last)."""
        last = len(batches) - 1
        for m, tokens in enumerate(batches):
            with self.microbatch(m == last):
                loss = lm_loss(self.model(tokens), tokens) / len(batches)
                mark("forward")
                loss.backward()
                mark("backward")


def build(name: str, model_cfg: ModelConfig, mp: hsdp.MixedPrecision, mesh: DeviceMesh,
          device: torch.device, fabric: Fabric | None, emulated: bool,
          float8: bool = False, tp_fabric: Fabric | None = None,
          outer_reduce: hsdp.OuterReduce | None = None,
          outer_gather: hsdp.OuterGather | None = None) -> Trainee:
    """The schedule's sharded model (seed 0) and its AdamW. ``fabric``: emulated collective
    durations (``emulated``: torch's fake process group); ``tp_fabric``: the TP ones (its
    inner link; a 3-D ``mesh`` only). ``float8``: torchao float8 linears with float8
    all-gather (``float8_model``). ``outer_reduce`` / ``outer_gather``: the compressed
    schedules' (default: int8)."""
    tp_mesh = mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None
    schedule = SCHEDULES[name]
    compressed = (outer_reduce or hsdp.OuterReduce()) if schedule.compressed else None
    gather = (outer_gather or hsdp.OuterGather()) if schedule.compressed_gather else None
    trainee = _build(name, model_cfg, mp, mesh, device, fabric, emulated, float8, tp_mesh,
                     compressed, gather)
    if tp_mesh is not None:
        sleep = time.sleep
        if tp_fabric is not None and device.type == "cuda":
            sleep = SleepClock.calibrate(device)
        tp_comm = partial(_tp_comm, tp_mesh, trainee.collective_bytes, tp_fabric, sleep)
        trainee.comm = partial(_both, trainee.comm, tp_comm)
    exchange = getattr(trainee.model, "exchange", None)
    if exchange is not None and exchange.group is not None:  # an MoE model's
        exchange.nbytes = trainee.collective_bytes
        sleep = SleepClock.calibrate(device) if device.type == "cuda" else time.sleep
        trainee.comm = partial(_both, trainee.comm,
                               partial(_ep_comm, exchange, fabric, sleep))
    return trainee


def _build(name: str, model_cfg: ModelConfig, mp: hsdp.MixedPrecision, mesh: DeviceMesh,
           device: torch.device, fabric: Fabric | None, emulated: bool, float8: bool,
           tp_mesh: DeviceMesh | None, outer_reduce: hsdp.OuterReduce | None,
           outer_gather: hsdp.OuterGather | None) -> Trainee:
    """``build`` without the TP collectives' interception."""
    torch.manual_seed(0)
    with torch.device(device):
        model = build_bench_model(model_cfg, mesh)
    if tp_mesh is not None:
        apply_llama_tp_plan(model, tp_mesh)
    if float8:
        model = float8_model(model, device)
    cuda = device.type == "cuda"
    schedule = SCHEDULES[name]
    drain = torch.cuda.synchronize if cuda else _nothing
    sleep, error = time.sleep, None
    if fabric is not None and cuda and schedule.library != "hsdp":
        clock = SleepClock.calibrate(device)
        sleep, error = clock, clock.check()
    if schedule.library == "hsdp":
        for unit, reshard, unit_mesh in [*unit_meshes(model, mesh), (model, True, mesh)]:
            hsdp.fully_shard(unit, mesh=unit_mesh, strategy=schedule.strategy, mp_policy=mp,
                             overlap_outer=schedule.overlap, reshard_after_forward=reshard,
                             outer_reduce=outer_reduce, outer_gather=outer_gather)
        if emulated:
            error = emulate(model, fabric, device)
        opt = _adamw(model.parameters(), schedule.graphs)
        tracer = model._hsdp_unit.tracer
        runtime_drain = partial(hsdp.synchronize, model)
        trainee = Trainee(name, model, tracer, partial(_delays, model),
                          partial(hsdp.microbatch, model),
                          partial(_update, opt, not schedule.graphs),
                          _chain(runtime_drain, drain), error)
        _count_bytes(model._hsdp_unit.collectives, trainee.collective_bytes)
        if schedule.graphs:
            trainee.graphed = GraphedSteps(model._hsdp_unit.collectives)
        return trainee
    tracer = Tracer()
    if schedule.library == "fsdp2":
        dp_mesh = mesh if tp_mesh is None else mesh["outer", "inner"]
        units = unit_meshes(model, dp_mesh, fsdp2=True)
        shard_fsdp2(model, units, dp_mesh, mp)
        opt = _adamw(model.parameters())
        nbytes: dict[str, int] = {}
        meshes = list({id(m): m for _, _, m in units}.values())
        comm = partial(_peer_comm, partial(fsdp2_collectives, meshes, tracer, nbytes),
                       fabric, sleep)
        update = partial(_update, opt)
        if float8:  # torchao's scale refresh for FSDP2, as torchtitan calls it
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
            update = _chain(update, partial(precompute_float8_dynamic_scale_for_fsdp, model))
        return Trainee(name, model, tracer, comm, partial(_fsdp2_microbatch, model), update,
                       drain, error, collective_bytes=nbytes)
    outer, inner = mesh.mesh.shape
    # Megatron-FSDP as its users run it: each block class a unit, the rest in the root.
    wrapped = shard_mfsdp(model, list(model.blocks), outer, inner, mp, device, _adamw)
    comm = partial(_peer_comm, partial(wrapped.collectives, tracer), fabric, sleep)
    return Trainee(name, wrapped.model, tracer, comm, partial(_mfsdp_microbatch, wrapped),
                   partial(_update, wrapped.optimizer), drain, error)


def build_unsharded(model_cfg: ModelConfig, mp: hsdp.MixedPrecision, inner: int,
                    device: torch.device, float8: bool = False,
                    tp_mesh: DeviceMesh | None = None) -> Trainee:
    """The reference of the module docstring (no collectives, nothing sharded but the
    optimizer's work); with ``tp_mesh`` the layers under the TP plan, each shard 1/inner
    of a TP-local parameter (its TP collectives: none under the fake process group); an
    MoE model with this rank's experts, each shard 1/(inner / ep) of them, no exchange."""
    torch.manual_seed(0)
    with torch.device(device):
        model = build_bench_model(model_cfg, None).to(mp.param_dtype or torch.float32)
        if tp_mesh is not None:
            apply_llama_tp_plan(model, tp_mesh)
        shards = [torch.zeros(math.ceil(local_of(p).numel() / n))
                  for p, n in zip(model.parameters(), shard_divisors(model, inner))]
    if float8:
        model = float8_model(model, device)
    for s in shards:
        s.grad = torch.zeros_like(s)
    opt = _adamw(shards)

    def update() -> None:
        opt.step()
        model.zero_grad(set_to_none=True)

    drain = torch.cuda.synchronize if device.type == "cuda" else _nothing
    return Trainee("unsharded", model, Tracer(), _no_context, _no_context, update, drain)


def float8_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with torchao float8 linears (tensorwise dynamic scaling, float8
    all-gather on; emulated matmuls off CUDA), as ``hsdp.float8.convert_to_float8`` makes
    them."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True,
                                emulate=device.type != "cuda")
    return convert_to_float8(model, config)


def _count_bytes(coll: Collectives, nbytes: dict[str, int]) -> None:
    """Add the bytes of each collective ``coll`` issues to ``nbytes["<kind>:<axis>"]``."""
    before = coll.before

    def counted(kind: str, axis: str, size: int, group_size: int) -> None:
        key = f"{kind}:{axis}"
        nbytes[key] = nbytes.get(key, 0) + size
        before(kind, axis, size, group_size)

    coll.before = counted


def synthetic_batches(vocab: int, mbs: int, seq: int, microbatches: int,
                      device: torch.device, tp: int = 1) -> list[torch.Tensor]:
    """This rank's token batches, one per microbatch (the same for every schedule; the
    same on the ``tp`` ranks of a TP group, tp fastest in the rank order)."""
    g = torch.Generator().manual_seed(1234 + dist.get_rank() // tp)
    return [torch.randint(0, vocab, (mbs, seq), generator=g).to(device)
            for _ in range(microbatches)]


# --------------------------------------------------------------------------- pieces


def _adamw(params, capturable: bool = False) -> torch.optim.Optimizer:
    """AdamW (``capturable``: its step count on the device, so that its step can be
    captured in a CUDA graph)."""
    return torch.optim.AdamW(params, lr=LR, foreach=True, capturable=capturable)


def _update(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """The optimizer step and clearing of gradients (in place for CUDA graphs: a captured
    backward adds into them)."""
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)


def _nothing() -> None:
    pass


def _chain(*fns: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        for fn in fns:
            fn()
    return run


def _no_context(*_args) -> AbstractContextManager:
    return nullcontext()


@contextmanager
def _both(first: Callable[[bool], AbstractContextManager],
          second: Callable[[bool], AbstractContextManager], on: bool) -> Iterator[None]:
    with first(on), second(on):
        yield


def _tp_comm(tp_mesh: DeviceMesh, nbytes: dict[str, int], fabric: Fabric | None,
             sleep: Callable[[float], None], on: bool) -> AbstractContextManager:
    return tp_collectives(tp_mesh, nbytes, fabric if on else None, sleep)


@contextmanager
def _delays(model: nn.Module, on: bool) -> Iterator[None]:
    """hsdp under emulation: its collectives take their modelled time only when ``on``."""
    coll = model._hsdp_unit.collectives
    if not isinstance(coll, DelayedCollectives):  # real collectives: nothing to switch
        yield
        return
    fabric = coll.fabric
    coll.fabric = fabric if on else None
    try:
        yield
    finally:
        coll.fabric = fabric


@contextmanager
def _ep_comm(exchange: EPExchange, fabric: Fabric | None, sleep: Callable[[float], None],
             on: bool) -> Iterator[None]:
    """An MoE model's token exchange delayed by its all-to-all's time on ``fabric``'s inner
    link (the ep ranks share a node), slept by ``sleep``, only when ``on``."""
    if on and fabric is not None:
        exchange.delay = lambda nbytes, ranks: sleep(
            fabric.seconds("all_to_all", "inner", nbytes, ranks))
    try:
        yield
    finally:
        exchange.delay = None


def _peer_comm(collectives: Callable[..., AbstractContextManager], fabric: Fabric | None,
               sleep: Callable[[float], None], on: bool) -> AbstractContextManager:
    return collectives(fabric if on else None, sleep)


@contextmanager
def _fsdp2_microbatch(model: nn.Module, is_last: bool) -> Iterator[None]:
    model.set_requires_all_reduce(is_last, recurse=True)
    yield


@contextmanager
def _mfsdp_microbatch(wrapped, is_last: bool) -> Iterator[None]:
    wrapped.microbatch(is_last)
    yield
