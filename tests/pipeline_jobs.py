"""Multi-rank job for tests/dist/test_pipeline.py: hsdp as the data-parallel layer of
torch.distributed.pipelining on 8 gloo ranks, 2 pipeline ranks x (2 outer x 2 inner):
a 4-block model split into stages, a few optimizer steps of each schedule and strategy,
against one process training the whole model on the same global batch."""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import hsdp
from hsdp.pipelining import PipelineStage
from hsdp.runtime import optim, runtime
from hsdp.runtime.hooks import units_below
from hsdp.sharding.comm import Collectives

PP, OUTER, INNER = 2, 2, 2
WIDTH, BLOCKS, MICROBATCHES, ROWS, STEPS, LR = 8, 4, 4, 2, 2, 0.1
MAX_NORM = 0.2  # below every step's gradient norm: the clip scales every step
SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1),
             "interleaved": (ScheduleInterleaved1F1B, 2)}  # class, stages per rank


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(BLOCKS)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: one slice of MICROBATCHES * ROWS rows per DP rank."""
    g = torch.Generator().manual_seed(100 + step)
    rows = OUTER * INNER * MICROBATCHES * ROWS
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def _reference() -> list[torch.Tensor]:
    """Every block's parameters after STEPS steps of the whole model in one process."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _stage_modules(pp_rank: int, per_rank: int, dp_mesh, strategy: str) -> list[tuple]:
    """(stage index, sharded stage module, the reference blocks' indices) of this rank:
    stage s holds BLOCKS / stages consecutive blocks; stages go round robin over ranks."""
    stages = PP * per_rank
    width = BLOCKS // stages
    out = []
    for s in range(pp_rank, stages, PP):
        blocks = list(range(s * width, (s + 1) * width))
        full = _model()
        stage = nn.Sequential(*(full[b] for b in blocks))
        for block in stage:
            hsdp.fully_shard(block, mesh=dp_mesh, strategy=strategy)
        hsdp.fully_shard(stage, mesh=dp_mesh, strategy=strategy)
        out.append((s, stage, blocks))
    return out


class _OuterReductions:
    """Counts the outer gradient reductions (all-reduce, reduce-scatter) hsdp issues."""

    def __init__(self) -> None:
        self.count = 0
        self._before = Collectives.before

    def __enter__(self) -> _OuterReductions:
        def before(coll, kind: str, axis: str, nbytes: int, group_size: int) -> None:
            if axis == "outer" and kind in ("all_reduce", "reduce_scatter"):
                self.count += 1
            self._before(coll, kind, axis, nbytes, group_size)

        Collectives.before = before
        return self

    def __exit__(self, *exc: object) -> None:
        Collectives.before = self._before


def _train(mesh, schedule: str, strategy: str) -> tuple[float, int, int, float]:
    """Largest relative parameter error of this rank's stages after STEPS steps (each
    clipped by ``hsdp.clip_grad_norm_`` over all stages); the outer reductions of the last
    step, the parameter groups of this rank's stages (one each); the smallest norm."""
    cls, per_rank = SCHEDULES[schedule]
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank = mesh["outer"].get_local_rank() * INNER + mesh["inner"].get_local_rank()
    stages = _stage_modules(pp_rank, per_rank, mesh["outer", "inner"], strategy)
    pipe = [PipelineStage(m, s, PP * per_rank, torch.device("cpu"), group=mesh["pp"].get_group())
            for s, m, _ in stages]
    sched = cls(pipe if per_rank > 1 else pipe[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
    params = [p for _, m, _ in stages for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    rows = MICROBATCHES * ROWS
    norms = []
    for step in range(STEPS):
        x, y = (t[dp_rank * rows:(dp_rank + 1) * rows] for t in _batch(step))
        first, last = pipe[0].is_first, pipe[-1].is_last
        # The last step alone: torch 2.13 infers shapes in the first with a backward of its own.
        with _OuterReductions() as outer:
            sched.step(*((x,) if first else ()), **({"target": y} if last else {}))
        norms.append(hsdp.clip_grad_norm_([m for _, m, _ in stages], MAX_NORM,
                                          pp_group=mesh["pp"]).item())
        opt.step()
        opt.zero_grad()
    groups = sum(len(u.groups) for _, m, _ in stages for u in units_below(m))
    ref = _reference()
    err = 0.0
    for _, m, blocks in stages:
        mine = list(hsdp.full_state_dict(m).values())
        want = [ref[2 * b + k] for b in blocks for k in (0, 1)]
        for a, b in zip(mine, want):
            err = max(err, ((a - b).abs().max() / b.abs().max()).item())
    hsdp.synchronize(stages[0][1])
    return err, outer.count, groups, min(norms)


CASES = (("gpipe", "hsdp"), ("1f1b", "hfsdp"), ("interleaved", "hfsdp"))


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


def pipeline_job(rank: int, world: int) -> dict[str, tuple[float, int, int, float]]:
    """Each (schedule, strategy) of CASES: ``_train``'s result on this rank."""
    mesh = init_device_mesh("cpu", (PP, OUTER, INNER), mesh_dim_names=("pp", "outer", "inner"))
    optim.STEPPERS = runtime.STEPPERS = _RankOrderedSet(mesh["outer"].get_local_rank() == 1)
    return {f"{schedule}/{strategy}": _train(mesh, schedule, strategy)
            for schedule, strategy in CASES}
