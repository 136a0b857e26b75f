"""Multi-rank job for tests/dist/test_pipeline.py: hsdp as the data-parallel layer of
torch.distributed.pipelining on 8 gloo ranks, 2 pipeline ranks x (2 outer x 2 inner):
a 4-block model split into stages, a few optimizer steps of each schedule and strategy,
against one process training the whole model on the same global batch."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_shard
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import hsdp
from hsdp.pipelining import PipelineStage
from hsdp.runtime import optim_hooks, runtime
from hsdp.runtime.hooks import units_below
from hsdp.sharding.comm import Collectives

PP, OUTER, INNER = 2, 2, 2
DP = OUTER * INNER
WIDTH, BLOCKS, MICROBATCHES, ROWS, STEPS, LR = 16, 4, 4, 2, 2, 0.1  # float8: dims % 16 == 0
MAX_NORM = 0.15  # below every step's gradient norm: the clip scales every step
SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1),
             "interleaved": (ScheduleInterleaved1F1B, 2)}  # class, stages per rank


@dataclass(frozen=True)
class Case:
    """One pipelined training run. ``precision``: "fp32" (against one process); "bf16"
    (bf16 parameters for compute, fp32 reduction: against FSDP2 + PP on the same
    schedule and mesh); "float8" (torchao's float8 linears, emulated, float8 all-gather:
    against one process)."""

    schedule: str
    strategy: str
    precision: str = "fp32"
    overlap_outer: bool = True
    container: bool = False  # an optimizer per stage, stepped by a container (torchtitan's)

    def __str__(self) -> str:
        serial = "" if self.overlap_outer else "/serial"
        return f"{self.schedule}/{self.strategy}/{self.precision}{serial}"


def _model(precision: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                            for _ in range(BLOCKS)))
    if precision == "float8":
        from torchao.float8 import Float8LinearConfig

        from hsdp.float8 import convert_to_float8

        config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
        model = convert_to_float8(model, config)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: one slice of MICROBATCHES * ROWS rows per DP rank."""
    g = torch.Generator().manual_seed(100 + step)
    rows = DP * MICROBATCHES * ROWS
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def _reference(precision: str) -> list[torch.Tensor]:
    """Every block's parameters after STEPS steps of the whole model in one process, each
    microbatch of each DP rank forwarded on its own (float8 scales each forward's input by
    its own amax) and its gradients accumulated: the pipelined run's computation."""
    model = _model(precision)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    chunks = DP * MICROBATCHES
    for step in range(STEPS):
        for x, y in zip(*(t.chunk(chunks) for t in _batch(step))):
            (_loss(model(x), y) / chunks).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _stage_modules(pp_rank: int, per_rank: int, dp_mesh, case: Case,
                   fsdp2: bool) -> list[tuple]:
    """(stage index, sharded stage module, the reference blocks' indices) of this rank:
    stage s holds BLOCKS / stages consecutive blocks; stages go round robin over ranks.
    Sharded by hsdp, or with ``fsdp2`` by torch's FSDP2 (same mixed precision)."""
    stages = PP * per_rank
    width = BLOCKS // stages
    bf16 = case.precision == "bf16"
    if fsdp2:
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None
        shard = functools.partial(fsdp2_shard, mesh=dp_mesh, mp_policy=policy)
    else:
        mp = hsdp.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
        shard = functools.partial(hsdp.fully_shard, mesh=dp_mesh, strategy=case.strategy,
                                  mp_policy=mp, overlap_outer=case.overlap_outer)
    out = []
    for s in range(pp_rank, stages, PP):
        blocks = list(range(s * width, (s + 1) * width))
        full = _model(case.precision)
        stage = nn.Sequential(*(full[b] for b in blocks))
        for block in stage:
            shard(block)
        shard(stage)
        out.append((s, stage, blocks))
    return out


def _clip_fsdp2(modules: list[nn.Module], pp_group) -> torch.Tensor:
    """torchtitan's clip of FSDP2 stages: each stage's norm over its DTensor gradients,
    then over the pipeline ranks."""
    params = [p for m in modules for p in m.parameters()]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor() ** 2
    dist.all_reduce(norm, group=pp_group)
    norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
    return norm


class _Container(torch.optim.Optimizer):
    """torchtitan's ``OptimizersContainer``, in short: an optimizer over every parameter
    (its step hooks run) whose step runs the step of each of its ``optimizers``."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]],
                         {})

    def step(self, closure: None = None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)


class _OuterCollectives:
    """Counts the outer gradient reductions (all-reduce, reduce-scatter) and the outer
    all-gathers hsdp issues."""

    def __init__(self) -> None:
        self.reductions = self.all_gathers = 0
        self._before = Collectives.before

    def __enter__(self) -> _OuterCollectives:
        def before(coll, kind: str, axis: str, nbytes: int, group_size: int) -> None:
            if axis == "outer" and kind in ("all_reduce", "reduce_scatter"):
                self.reductions += 1
            if axis == "outer" and kind == "all_gather":
                self.all_gathers += 1
            self._before(coll, kind, axis, nbytes, group_size)

        Collectives.before = before
        return self

    def __exit__(self, *exc: object) -> None:
        Collectives.before = self._before


def _train(mesh, case: Case, fsdp2: bool = False) -> tuple[list, int, int, int, float]:
    """This rank's stages after STEPS steps (each clipped over all stages): (its blocks'
    parameters with the reference's indices of them); the outer reductions and outer
    all-gathers hsdp issued in the last step, the parameter groups of this rank's stages;
    the smallest norm."""
    cls, per_rank = SCHEDULES[case.schedule]
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank = mesh["outer"].get_local_rank() * INNER + mesh["inner"].get_local_rank()
    stages = _stage_modules(pp_rank, per_rank, mesh["outer", "inner"], case, fsdp2)
    stage_cls = TorchStage if fsdp2 else PipelineStage
    pipe = [stage_cls(m, s, PP * per_rank, torch.device("cpu"), group=mesh["pp"].get_group())
            for s, m, _ in stages]
    sched = cls(pipe if per_rank > 1 else pipe[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
    modules = [m for _, m, _ in stages]
    opt = (_Container([torch.optim.SGD(m.parameters(), lr=LR) for m in modules])
           if case.container else
           torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR))
    rows = MICROBATCHES * ROWS
    norms = []
    for step in range(STEPS):
        x, y = (t[dp_rank * rows:(dp_rank + 1) * rows] for t in _batch(step))
        first, last = pipe[0].is_first, pipe[-1].is_last
        # The last step alone: torch 2.13 infers shapes in the first with a backward of its own.
        with _OuterCollectives() as outer:
            sched.step(*((x,) if first else ()), **({"target": y} if last else {}))
            norm = (_clip_fsdp2(modules, mesh["pp"].get_group()) if fsdp2 else
                    hsdp.clip_grad_norm_(modules, MAX_NORM, pp_group=mesh["pp"]))
            opt.step()
            for m in [] if fsdp2 else modules:
                hsdp.synchronize(m)  # the outer all-gathers after the step ran: counted
        norms.append(norm.item())
        opt.zero_grad()
    if fsdp2:
        params = [(blocks, [p.full_tensor() for p in m.parameters()]) for _, m, blocks in stages]
        return params, 0, 0, 0, min(norms)
    params = [(blocks, list(hsdp.full_state_dict(m).values())) for _, m, blocks in stages]
    groups = sum(len(u.groups) for m in modules for u in units_below(m))
    hsdp.synchronize(modules[0])
    return params, outer.reductions, outer.all_gathers, groups, min(norms)


def _rel(got: list, want: list[torch.Tensor] | list) -> float:
    """Largest relative error of ``got`` (``_train``'s parameters) against ``want``: the
    reference's parameters by index, or another ``_train``'s parameters."""
    err = 0.0
    for i, (blocks, mine) in enumerate(got):
        other = ([want[2 * b + k] for b in blocks for k in (0, 1)]
                 if isinstance(want[0], torch.Tensor) else want[i][1])
        for a, b in zip(mine, other):
            err = max(err, ((a.float() - b.float()).abs().max() / b.abs().max()).item())
    return err


class _RankOrderedSet(weakref.WeakSet):
    """hsdp's registry of models (``STEPPERS``) iterated in the order they were added on
    even outer ranks and the reverse on odd ones: a real set's order follows addresses,
    which differ between ranks by chance; here they differ for sure, so that a collective
    issued in the registry's order mismatches between the two ranks of an outer group."""

    def __init__(self, reverse: bool) -> None:
        super().__init__()
        self._reverse = reverse
        self._added: list[weakref.ref] = []

    def add(self, item: object) -> None:
        super().add(item)
        self._added.append(weakref.ref(item))

    def __iter__(self):
        items = [r() for r in self._added]
        items = [x for x in items if x is not None and x in self]
        return iter(items[::-1] if self._reverse else items)


def pipeline_job(rank: int, world: int,
                 cases: list[Case]) -> dict[Case, tuple[float, int, int, int, float, float]]:
    """Each case: (the largest relative parameter error against its reference, the outer
    reductions and outer all-gathers of the last step, the parameter groups of this
    rank's stages, the smallest gradient norm, the error against one process in fp32:
    not small where the precision took effect) on this rank."""
    mesh = init_device_mesh("cpu", (PP, OUTER, INNER), mesh_dim_names=("pp", "outer", "inner"))
    optim_hooks.STEPPERS = runtime.STEPPERS = _RankOrderedSet(mesh["outer"].get_local_rank() == 1)
    fp32 = _reference("fp32")
    out = {}
    for case in cases:
        params, *rest = _train(mesh, case)
        want = (_train(mesh, case, fsdp2=True)[0] if case.precision == "bf16"
                else _reference(case.precision))
        out[case] = (_rel(params, want), *rest, _rel(params, fp32))
    return out
