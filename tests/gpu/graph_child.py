"""CUDA graph checks, each in a fresh process (one process group per process).

    python tests/gpu/graph_child.py parity|overlap|compressed   -> prints one JSON line

parity: real NCCL at world size 1 (a 1x1 mesh): 10 steps of graph replay against eager,
hsdp and hfsdp, 1 and 3 microbatches, activation checkpointing, forward + backward
captured (all microbatches in one graph, and torchtitan's way: one graph per microbatch
replayed for each), the optimizer step eager or captured on its own.
compressed: the compressed outer reduction (int8, error feedback) and hfsdp's compressed
outer all-gather on a fake 2x2 mesh whose collectives give every rank what this one holds
(``Loopback``: deterministic values, so replay and eager must agree bit for bit), the same
ways of capturing as parity's.
overlap: a fake 2x2 mesh with emulated collectives (slow outer link): the replayed step
with the outer reduction on its own stream against the serialized schedule.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import torch
import torch.distributed as dist

import hsdp
from hsdp.sharding.comm import Collectives
from hsdp.streams.capture import CaptureError
from hsdp_tools.bench.emulate import emulate, fake_mesh
from hsdp_tools.models import GPT, GPTConfig, lm_loss
from hsdp_tools.sim.fabric import Fabric, Link

DEV = torch.device("cuda", 0)
CFG = GPTConfig(vocab=101, hidden=96, heads=4, ffn=200, layers=3, seq=32,
                checkpoint="non_reentrant")


def _shard(model: GPT, mesh, **kw) -> GPT:
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, **kw)
    return hsdp.fully_shard(model, mesh=mesh, **kw)


def _fwd_bwd(model, tokens: torch.Tensor, n_micro: int, per_micro: bool) -> torch.Tensor:
    """The step's forward + backward over ``tokens``; ``per_micro``: one microbatch (no
    hsdp.microbatch: a whole step each, accumulating into the set gradients)."""
    if per_micro:
        loss = lm_loss(model(tokens), tokens).div(n_micro)
        loss.backward()
        return loss.detach()
    total = torch.zeros((), device=DEV)
    for i, t in enumerate(tokens.chunk(n_micro)):
        with hsdp.microbatch(model, is_last=i == n_micro - 1):
            loss = lm_loss(model(t), t).div(n_micro)
            loss.backward()
        total += loss.detach()
    return total


class Graphed:
    """Step 0 eager, then forward + backward captured once and replayed; the optimizer
    step eager, or (``capture_opt``) captured from step 2 on."""

    def __init__(self, model, opt, n_micro: int, per_micro: bool, capture_opt: bool):
        self.model, self.opt, self.n, self.per_micro = model, opt, n_micro, per_micro
        self.capture_opt = capture_opt
        self.fb = self.step_graph = None
        self.tokens = None

    def step(self, step: int, tokens: torch.Tensor) -> list[float]:
        chunks = tokens.chunk(self.n) if self.per_micro else [tokens]
        losses = []
        if step == 0:
            losses = [_fwd_bwd(self.model, c, self.n, self.per_micro) for c in chunks]
        else:
            if self.fb is None:
                self.tokens = chunks[0].clone()
                self.fb = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.fb):
                    self.loss = _fwd_bwd(self.model, self.tokens, self.n, self.per_micro)
            for c in chunks:
                self.tokens.copy_(c)
                self.fb.replay()
                losses.append(self.loss.clone())
        if self.capture_opt and step >= 2:
            if self.step_graph is None:
                self.step_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.step_graph):
                    self.opt.step()
            self.step_graph.replay()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        return [float(x) for x in losses]


def _eager_step(model, opt, tokens, n_micro: int, per_micro: bool) -> list[float]:
    chunks = tokens.chunk(n_micro) if per_micro else [tokens]
    losses = [float(_fwd_bwd(model, c, n_micro, per_micro)) for c in chunks]
    opt.step()
    opt.zero_grad(set_to_none=False)
    return losses


def parity() -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29571"),
                      RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=DEV)
    mesh = hsdp.init_mesh(1, 1, "cuda")
    out = {}
    # hsdp with a bf16 reduction and an all-reduce hook (which keeps the outer all-reduce
    # on one outer rank): a captured step of one backward adds the uncleared gradients in
    # place, in the all-reduce's cast (per_micro: each backward a step, adding to the last)
    for strategy, reduce in (("hsdp", None), ("hfsdp", None), ("hsdp", torch.bfloat16)):
        for n_micro in (1, 3):
            for per_micro, capture_opt in ((False, False), (False, True), (True, False)):
                torch.manual_seed(0)
                ref = GPT(CFG).to(DEV)
                models = [_shard(copy.deepcopy(ref), mesh, strategy=strategy,
                                 mp_policy=hsdp.MixedPrecision(reduce_dtype=reduce))
                          for _ in range(2)]
                if reduce is not None:
                    for m in models:
                        for unit in (*m.blocks, m):
                            unit.set_all_reduce_hook(lambda t: None)
                opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
                graphed = Graphed(models[1], opts[1], n_micro, per_micro, capture_opt)
                loss_diff = 0.0
                for step in range(10):
                    tokens = torch.randint(0, CFG.vocab, (6, CFG.seq), device=DEV,
                                           generator=torch.Generator(DEV).manual_seed(step))
                    a = _eager_step(models[0], opts[0], tokens, n_micro, per_micro)
                    b = graphed.step(step, tokens)
                    loss_diff = max(loss_diff, *(abs(x - y) for x, y in zip(a, b)))
                torch.cuda.synchronize()
                with torch.no_grad():
                    equal = all(torch.equal(p.full_tensor(), q.full_tensor())
                                for p, q in zip(*(m.parameters() for m in models)))
                key = (f"{strategy}{'-bf16' if reduce else ''}/micro{n_micro}/"
                       f"{'per_micro' if per_micro else 'one_graph'}"
                       f"{'/opt_graph' if capture_opt else ''}")
                out[key] = {"bit_equal": equal, "max_loss_diff": loss_diff,
                            "steps_agreed": models[1]._hsdp_unit.runtime.graphs.steps}
                hsdp.synchronize(models[1])
    out["refusal"] = _refusal(mesh)
    return out


def _refusal(mesh) -> str:
    """Capturing a backward whose gradients were cleared with set_to_none raises a
    CaptureError inside the capture, before anything is recorded."""
    torch.manual_seed(0)
    model = _shard(GPT(CFG).to(DEV), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq), device=DEV)
    _eager_step(model, opt, tokens, 1, True)
    opt.zero_grad(set_to_none=True)
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            _fwd_bwd(model, tokens, 1, True)
    except CaptureError as exc:
        _eager_step(model, opt, tokens, 1, True)  # and it still trains eagerly
        return str(exc)
    return "not refused"


class Loopback(Collectives):
    """Collectives on a fake process group as if every rank held what this one holds
    (every result written: nothing is left as the fake backend leaves it)."""

    def all_gather(self, out, inp, group, axis) -> None:
        n = dist.get_world_size(group)
        out.view(n, -1).copy_(inp.reshape(1, -1).clone().expand(n, -1))

    def all_to_all(self, out, inp, group, axis) -> None:
        out.copy_(inp)

    def reduce_scatter(self, out, inp, group, axis, avg=False) -> None:
        n = dist.get_world_size(group)
        out.copy_(inp.reshape(n, -1)[0].view_as(out))
        if not avg:
            out.mul_(n)

    def all_reduce(self, t, group, axis, avg=False) -> None:
        if not avg:
            t.mul_(dist.get_world_size(group))


def compressed() -> dict:
    """Eager against graphed, 10 steps each: hsdp and hfsdp with outer_reduce="int8",
    hfsdp with outer_gather="int8" too; 1 and 3 microbatches in one graph, one graph per
    microbatch (each backward a reduction: the residual chains on the device), the
    optimizer step captured."""
    mesh = fake_mesh(2, 2, "cuda")
    out = {}
    for strategy, gather in (("hsdp", None), ("hfsdp", None), ("hfsdp", "int8")):
        for n_micro, per_micro, capture_opt in ((1, False, False), (3, False, False),
                                                (3, True, False), (1, False, True)):
            torch.manual_seed(0)
            ref = GPT(CFG).to(DEV)
            kw = dict(strategy=strategy, outer_reduce="int8")
            if gather:
                kw["outer_gather"] = gather
            models = [_shard(copy.deepcopy(ref), mesh, **kw) for _ in range(2)]
            for m in models:
                m._hsdp_unit.collectives = Loopback()
            opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
            graphed = Graphed(models[1], opts[1], n_micro, per_micro, capture_opt)
            loss_diff = 0.0
            for step in range(10):
                tokens = torch.randint(0, CFG.vocab, (6, CFG.seq), device=DEV,
                                       generator=torch.Generator(DEV).manual_seed(step))
                a = _eager_step(models[0], opts[0], tokens, n_micro, per_micro)
                b = graphed.step(step, tokens)
                loss_diff = max(loss_diff, *(abs(x - y) for x, y in zip(a, b)))
            torch.cuda.synchronize()
            with torch.no_grad():
                equal = all(torch.equal(p.to_local(), q.to_local())
                            for p, q in zip(*(m.parameters() for m in models)))
                residuals = [[g.compressed.residual for g in m._hsdp_unit.runtime.ctx.groups
                              if g.compressed is not None] for m in models]
                same_residual = all(torch.equal(x, y) for x, y in zip(*residuals))
            key = (f"{strategy}{'-gather' if gather else ''}/micro{n_micro}/"
                   f"{'per_micro' if per_micro else 'one_graph'}"
                   f"{'/opt_graph' if capture_opt else ''}")
            out[key] = {"bit_equal": equal, "residual_equal": same_residual,
                        "residuals": len(residuals[1]), "max_loss_diff": loss_diff,
                        "finite": all(math.isfinite(x) for x in b)}
            for m in models:
                hsdp.synchronize(m)
    return out


def overlap() -> dict:
    """Replayed steps on a fake 2x2 mesh, outer link at 10 GB/s: overlap vs serial
    (interleaved), hsdp and hfsdp; step time in ms, median [min, max] of 10 replays."""
    mesh = fake_mesh(2, 2, "cuda")
    cfg = GPTConfig(vocab=512, hidden=2048, heads=16, ffn=8192, layers=6, seq=1024)
    out = {}
    for strategy in ("hsdp", "hfsdp"):
        runs = {}
        for overlap_outer in (True, False):
            torch.manual_seed(0)
            model = _shard(GPT(cfg).to(DEV), mesh, strategy=strategy,
                           overlap_outer=overlap_outer,
                           mp_policy=hsdp.MixedPrecision(torch.bfloat16, torch.float32))
            emulate(model, Fabric(outer=Link(10.0)), DEV)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            tokens = torch.randint(0, cfg.vocab, (2, cfg.seq), device=DEV)
            _eager_step(model, opt, tokens, 1, True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _fwd_bwd(model, tokens, 1, True)
            runs[overlap_outer] = (model, opt, graph, tokens)  # the graph reads tokens
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(12):
            for key, (_model, opt, graph, _tokens) in runs.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                opt.step()
                opt.zero_grad(set_to_none=False)
                end.synchronize()
                times[key].append(start.elapsed_time(end))
        for key, ts in times.items():
            ts = sorted(ts[2:])
            out[f"{strategy}/{'overlap' if key else 'serial'}"] = [
                ts[len(ts) // 2], ts[0], ts[-1]]
        for model, *_ in runs.values():
            hsdp.synchronize(model)
    return out


if __name__ == "__main__":
    torch.cuda.set_device(DEV)
    try:
        modes = {"parity": parity, "overlap": overlap, "compressed": compressed}
        print(json.dumps(modes[sys.argv[1]]()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
