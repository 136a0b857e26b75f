"""The step bench's trainees: one model + optimizer per schedule, stepped the same way.

Schedules (same mesh, same seed, same synthetic tokens; each block is a unit, the root last):

- ``overlap``: hsdp, outer all-reduce on its own stream (``overlap_outer=True``);
- ``serial``: hsdp, outer all-reduce on the rs stream (the baseline of docs/design.md);
- ``hfsdp`` / ``hfsdp-serial``: the same with strategy hfsdp;
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on the same 2-D mesh (HSDP);
- ``mfsdp``: Megatron-FSDP as HSDP on the same ranks (``hsdp.bench.mfsdp``; optional).

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
from hsdp.bench.emulate import DelayedCollectives, SleepClock, emulate
from hsdp.bench.fsdp2 import fsdp2_collectives, shard_fsdp2
from hsdp.bench.mfsdp import shard_mfsdp
from hsdp.models import ModelConfig, build_model, lm_loss, shard_units
from hsdp.runtime.streams import Tracer
from hsdp.sim.fabric import Fabric


@dataclass(frozen=True)
class Schedule:
    """``library``: "hsdp", "fsdp2" or "mfsdp"; hsdp's strategy and overlap_outer."""

    library: str
    strategy: str | None = None
    overlap: bool | None = None


SCHEDULES: dict[str, Schedule] = {
    "overlap": Schedule("hsdp", "hsdp", True), "serial": Schedule("hsdp", "hsdp", False),
    "hfsdp": Schedule("hsdp", "hfsdp", True), "hfsdp-serial": Schedule("hsdp", "hfsdp", False),
    "fsdp2": Schedule("fsdp2"), "mfsdp": Schedule("mfsdp")}
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

    def step(self, batches: list[torch.Tensor], delays: bool = True,
             mark: Callable[[str], None] = _no_mark) -> float:
        """One optimizer step over all microbatches, returning once every stream is idle.
        ``mark(phase)`` is called at the end of each phase of ``PHASES`` (once per
        microbatch for forward and backward). Returns the host time (s) spent issuing the
        step: until the optimizer step and clearing of gradients returned, before waiting
        for the device."""
        last = len(batches) - 1
        t0 = time.perf_counter()
        with self.comm(delays):
            for m, tokens in enumerate(batches):
                with self.microbatch(m == last):
                    loss = lm_loss(self.model(tokens), tokens) / len(batches)
                    mark("forward")
                    loss.backward()
                    mark("backward")
            self.update()
            mark("optimizer")
            host = time.perf_counter() - t0
            self.drain()
        return host


def build(name: str, model_cfg: ModelConfig, mp: hsdp.MixedPrecision, mesh: DeviceMesh,
          device: torch.device, fabric: Fabric | None, emulated: bool) -> Trainee:
    """The schedule's sharded model (seed 0) and its AdamW. ``fabric``: emulated collective
    durations (``emulated``: torch's fake process group)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(model_cfg)
    units = shard_units(model)
    cuda = device.type == "cuda"
    schedule = SCHEDULES[name]
    drain = torch.cuda.synchronize if cuda else _nothing
    sleep, error = time.sleep, None
    if fabric is not None and cuda and schedule.library != "hsdp":
        clock = SleepClock.calibrate(device)
        sleep, error = clock, clock.check()
    if schedule.library == "hsdp":
        for unit, reshard in [*units, (model, True)]:
            hsdp.fully_shard(unit, mesh=mesh, strategy=schedule.strategy, mp_policy=mp,
                             overlap_outer=schedule.overlap, reshard_after_forward=reshard)
        if emulated:
            error = emulate(model, fabric, device)
        opt = _adamw(model.parameters())
        tracer = model._hsdp_unit.tracer
        runtime_drain = partial(hsdp.synchronize, model)
        return Trainee(name, model, tracer, partial(_delays, model), partial(hsdp.microbatch,
                       model), partial(_update, opt), _chain(runtime_drain, drain), error)
    tracer = Tracer()
    if schedule.library == "fsdp2":
        shard_fsdp2(model, units, mesh, mp)
        opt = _adamw(model.parameters())
        comm = partial(_peer_comm, partial(fsdp2_collectives, mesh, tracer), fabric, sleep)
        return Trainee(name, model, tracer, comm, partial(_fsdp2_microbatch, model),
                       partial(_update, opt), drain, error)
    outer, inner = mesh.mesh.shape
    # Megatron-FSDP as its users run it: each block class a unit, the rest in the root.
    wrapped = shard_mfsdp(model, list(model.blocks), outer, inner, mp, device, _adamw)
    comm = partial(_peer_comm, partial(wrapped.collectives, tracer), fabric, sleep)
    return Trainee(name, wrapped.model, tracer, comm, partial(_mfsdp_microbatch, wrapped),
                   partial(_update, wrapped.optimizer), drain, error)


def build_unsharded(model_cfg: ModelConfig, mp: hsdp.MixedPrecision, inner: int,
                    device: torch.device) -> Trainee:
    """The reference of the module docstring (no collectives, nothing sharded but the
    optimizer's work)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(model_cfg).to(mp.param_dtype or torch.float32)
        shards = [torch.zeros(math.ceil(p.numel() / inner)) for p in model.parameters()]
    for s in shards:
        s.grad = torch.zeros_like(s)
    opt = _adamw(shards)

    def update() -> None:
        opt.step()
        model.zero_grad(set_to_none=True)

    drain = torch.cuda.synchronize if device.type == "cuda" else _nothing
    return Trainee("unsharded", model, Tracer(), _no_context, _no_context, update, drain)


def synthetic_batches(vocab: int, mbs: int, seq: int, microbatches: int,
                      device: torch.device) -> list[torch.Tensor]:
    """This rank's token batches, one per microbatch (the same for every schedule)."""
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    return [torch.randint(0, vocab, (mbs, seq), generator=g).to(device)
            for _ in range(microbatches)]


# --------------------------------------------------------------------------- pieces


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, foreach=True)


def _update(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad(set_to_none=True)


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
