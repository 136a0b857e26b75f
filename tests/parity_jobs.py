"""Multi-rank training jobs compared with a single-process reference (and torch FSDP2).

Rank r of the (outer x inner) mesh takes rows [r*b, (r+1)*b) of each global microbatch;
its loss is the mean over its rows divided by the number of microbatches, so the mean of
the ranks' gradients is the reference's gradient.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import hsdp
from hsdp.sharding.group import owner
from hsdp_tools.models import GPT, GPTConfig, lm_loss

ROWS_PER_RANK = 2
STEPS = 4
LR, MOMENTUM = 0.1, 0.9
CLIP = 0.05  # below every gradient norm of these runs: clipping is active


@dataclass(frozen=True)
class Case:
    outer: int
    inner: int
    strategy: str = "hsdp"
    overlap: bool = True
    microbatches: int = 1
    checkpoint: str = "none"
    mp: str = ""  # "" (fp32), or "bf16-fp32" / "bf16-bf16": param dtype - reduce dtype
    fsdp2: bool = False  # also train torch FSDP2 HSDP and compare
    clip: str = ""  # "torch-2" / "hsdp-inf" ...: clip_grad_norm_ (whose, norm type) each step
    device: str = "cpu"  # "cuda": NCCL ranks, one GPU each (tests/gpu/test_multi_gpu.py)
    outer_reduce: str = ""  # "int8" / "fp8_e4m3" (+ "-noef"): compressed outer reduction

    @property
    def torch_device(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device)


_MP_DTYPES = {"bf16-fp32": (torch.bfloat16, torch.float32),
              "bf16-bf16": (torch.bfloat16, torch.bfloat16)}


def _outer_reduce(case: Case) -> hsdp.OuterReduce | None:
    if not case.outer_reduce:
        return None
    dtype, _, noef = case.outer_reduce.partition("-")
    return hsdp.OuterReduce(dtype, block=16, error_feedback=noef != "noef")


def _batches(step: int, micro: int, world: int, cfg: GPTConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, cfg.vocab, (world * ROWS_PER_RANK, cfg.seq), generator=g)


def _rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k].float().cpu() - b[k].float().cpu()).norm()
                / b[k].float().cpu().norm().clamp_min(1e-12)).item() for k in a)


def _clip(model: nn.Module, case: Case, sharded: str) -> float:
    """Clip with torch's clip_grad_norm_ (the reference always does) or hsdp's; the total
    norm before clipping."""
    who, norm_type = case.clip.split("-")
    norm_type = float(norm_type)
    if who == "hsdp" and sharded == "hsdp":
        return hsdp.clip_grad_norm_(model, CLIP, norm_type).item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, norm_type)
    return norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item()


def _train(model: nn.Module, rank: int, world: int, cfg: GPTConfig, case: Case,
           sharded: str) -> list[float]:
    """Train ``model`` for STEPS steps. sharded: "ref" (whole batch), "hsdp" or "fsdp2".
    Returns the gradient norms clipping saw (if the case clips)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    M = case.microbatches
    norms = []
    for step in range(STEPS):
        for m in range(M):
            tokens = _batches(step, m, world, cfg).to(case.torch_device)
            if sharded != "ref":
                tokens = tokens[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
            last = m == M - 1
            if sharded == "hsdp":
                with hsdp.microbatch(model, is_last=last):
                    (lm_loss(model(tokens), tokens) / M).backward()
            else:
                if sharded == "fsdp2":
                    model.set_requires_all_reduce(last, recurse=True)
                (lm_loss(model(tokens), tokens) / M).backward()
        if case.clip:
            norms.append(_clip(model, case, sharded))
        opt.step()
        opt.zero_grad()
    return norms


def _fsdp2_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().cpu() for k, v in model.state_dict().items()}


def parity_job(rank: int, world: int, cases: list[Case]) -> dict[Case, dict[str, float]]:
    """For each case: relative error of hsdp (and FSDP2) parameters against the reference."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    meshes = {}
    out = {}
    for case in cases:
        key = (case.outer, case.inner, case.device)
        if key not in meshes:
            meshes[key] = hsdp.init_mesh(case.outer, case.inner, case.device)
        mesh = meshes[key]
        cfg = GPTConfig(checkpoint=case.checkpoint)
        torch.manual_seed(0)
        ref = GPT(cfg).to(case.torch_device)
        model = copy.deepcopy(ref)
        fsdp2 = copy.deepcopy(ref) if case.fsdp2 else None
        dtypes = _MP_DTYPES.get(case.mp)
        mp = hsdp.MixedPrecision(*dtypes) if dtypes else None
        for blk in model.blocks:
            hsdp.fully_shard(blk, mesh=mesh, strategy=case.strategy, mp_policy=mp,
                             overlap_outer=case.overlap, outer_reduce=_outer_reduce(case))
        hsdp.fully_shard(model, mesh=mesh, strategy=case.strategy, mp_policy=mp,
                         overlap_outer=case.overlap, outer_reduce=_outer_reduce(case))
        ref_norms = _train(ref, rank, world, cfg, case, "ref")
        norms = _train(model, rank, world, cfg, case, "hsdp")
        ref_state = {k: v.detach() for k, v in ref.state_dict().items()}
        errs = {"ref": _rel_err(hsdp.full_state_dict(model), ref_state)}
        if case.clip:  # clipping was active: the norms exceed the bound
            errs["norm"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
            errs["clipped"] = min(ref_norms) > CLIP
        if fsdp2 is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy
            from torch.distributed.fsdp import fully_shard as fsdp2_shard
            policy = MixedPrecisionPolicy(*dtypes) if dtypes else MixedPrecisionPolicy()
            for blk in fsdp2.blocks:
                fsdp2_shard(blk, mesh=mesh, mp_policy=policy)
            fsdp2_shard(fsdp2, mesh=mesh, mp_policy=policy)
            _train(fsdp2, rank, world, cfg, case, "fsdp2")
            f2 = _fsdp2_state(fsdp2)
            errs["fsdp2_vs_ref"] = _rel_err(f2, ref_state)
            errs["hsdp_vs_fsdp2"] = _rel_err(hsdp.full_state_dict(model), f2)
        out[case] = errs
    return out


class Odd(nn.Module):
    """Odd shapes, a 1-D parameter, a frozen layer and a layer used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.frozen = nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.twice = nn.Linear(13, 13)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.twice(torch.tanh(self.twice(self.frozen(h)))))
        return h * self.scale


class OddNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Odd(), Odd()
        self.out = nn.Linear(13, 3)
        self.b.inp = nn.Linear(13, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b(self.a(x)))


def odd_job(rank: int, world: int, outer: int, strategy: str) -> dict[str, float]:
    """Frozen / shared / 1-D parameters, plus clip_grad_norm_ against the reference."""
    mesh = hsdp.init_mesh(outer, world // outer, "cpu")
    torch.manual_seed(0)
    ref = OddNet()
    model = copy.deepcopy(ref)
    hsdp.fully_shard(model.a, mesh=mesh, strategy=strategy)
    hsdp.fully_shard(model.b, mesh=mesh, strategy=strategy)
    hsdp.fully_shard(model, mesh=mesh, strategy=strategy)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR,
                            momentum=MOMENTUM) for m in (ref, model)]
    norms = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world * ROWS_PER_RANK, 7, generator=g)
        y = torch.randn(world * ROWS_PER_RANK, 3, generator=g)
        sl = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        nn.functional.mse_loss(ref(x), y).backward()
        nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        inf = float("inf")  # max-norm first, with a bound that clips nothing
        i_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=inf).item()
        i_mine = hsdp.clip_grad_norm_(model, 1e9, norm_type=inf).item()
        i_torch = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type=inf)
        t_mine = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
        n_mine = hsdp.clip_grad_norm_(model, 0.05).item()
        for mine, want in ((n_mine, n_ref), (t_mine.full_tensor().item(), n_ref),
                           (i_mine, i_ref), (i_torch.full_tensor().item(), i_ref)):
            norms.append(abs(mine - want) / want)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ref_state = {k: v.detach() for k, v in ref.state_dict().items()}
    local = sum(p.to_local().numel() for p in model.parameters())
    return {"param": _rel_err(hsdp.full_state_dict(model), ref_state), "norm": max(norms),
            "local_numel": local, "full_numel": sum(p.numel() for p in ref.parameters())}


def checkpoint_job(rank: int, world: int, outer: int) -> dict[str, float]:
    """full_state_dict -> load_full_state_dict into a differently initialized model:
    the loaded model equals the saved one, also after training both one more step."""
    mesh = hsdp.init_mesh(outer, world // outer, "cpu")
    cfg = GPTConfig()
    out = {}
    for strategy, mp in (("hsdp", None), ("hfsdp", None),
                         ("hfsdp", hsdp.MixedPrecision(torch.bfloat16, torch.float32))):
        models = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            m = GPT(cfg)
            for blk in m.blocks:
                hsdp.fully_shard(blk, mesh=mesh, strategy=strategy, mp_policy=mp)
            models.append(hsdp.fully_shard(m, mesh=mesh, strategy=strategy, mp_policy=mp))
        src, dst = models
        case = Case(outer, world // outer, strategy)
        _train(src, rank, world, cfg, case, "hsdp")
        saved = hsdp.full_state_dict(src)
        hsdp.load_full_state_dict(dst, saved)
        key = f"{strategy}/{'bf16' if mp else 'fp32'}"
        out[f"{key}/loaded"] = _rel_err(hsdp.full_state_dict(dst), saved)
        for m in models:
            _train(m, rank, world, cfg, case, "hsdp")
        out[f"{key}/trained"] = _rel_err(hsdp.full_state_dict(dst), hsdp.full_state_dict(src))
    return out


def adamw_job(rank: int, world: int, outer: int) -> dict[str, tuple[bool, bool]]:
    """AdamW over hsdp's DTensor parameters against AdamW over plain 1-D views of the same
    pieces (the representation before DTensors): (bit-for-bit equal, weights moved)."""
    mesh = hsdp.init_mesh(outer, world // outer, "cpu")
    cfg = GPTConfig()
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    out = {}
    impls = {"foreach": {"foreach": True}, "for-loop": {"foreach": False},
             "fused": {"fused": True}}
    for strategy, impl in itertools.product(("hsdp", "hfsdp"), impls):
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            m = GPT(cfg)
            for blk in m.blocks:
                hsdp.fully_shard(blk, mesh=mesh, strategy=strategy)
            models.append(hsdp.fully_shard(m, mesh=mesh, strategy=strategy))
        start = hsdp.full_state_dict(models[0])
        params = list(models[1].parameters())
        plain = [owner(p)[0].params[owner(p)[1]].local.view(-1) for p in params]  # fresh views
        kw = dict(lr=1e-2, weight_decay=0.1, **impls[impl])
        opts = [torch.optim.AdamW(models[0].parameters(), **kw), torch.optim.AdamW(plain, **kw)]
        for step in range(STEPS):
            tokens = _batches(step, 0, world, cfg)[rows]
            for m in models:
                lm_loss(m(tokens), tokens).backward()
            for p, v in zip(params, plain):
                v.grad = p.grad.to_local()[:v.numel()]  # not the empty pieces' placeholders
            for m, opt in zip(models, opts):
                opt.step()
                opt.zero_grad()
                m.zero_grad()
            if impl == "fused":  # torch's fused kernels bump no version counter, from
                # which hfsdp learns that the plain views were written (hsdp's own
                # optimizer hook marks its parameters written whatever the kernel)
                torch.autograd.graph.increment_version(plain)
        a, b = (hsdp.full_state_dict(m) for m in models)
        out[f"{strategy}/{impl}"] = (all(torch.equal(a[k], b[k]) for k in a),
                                     any(not torch.equal(a[k], start[k]) for k in a))
    return out


def lagging_outer_job(rank: int, world: int, no_hold: bool = False) -> dict[str, bool]:
    """bf16 reduction on real NCCL over an outer axis of ``world`` ranks, whose link is
    emulated at 1 GB/s on top of the real all-reduce: the outer stream runs several units
    behind the backward, while the reduce-scatter stream allocates the next units'
    results. Whether the overlapped schedule's parameters after three steps equal the
    serialized one's bit for bit. ``no_hold``: without ``SideStream.hold`` (a check that
    this job sees the reuse it guards against)."""
    from hsdp.streams.cuda_backend import CudaSideStream
    from hsdp_tools.bench.emulate import emulate
    from hsdp_tools.models import GPT, GPTConfig, lm_loss
    from hsdp_tools.sim.fabric import Fabric, Link

    if no_hold:
        CudaSideStream.hold = lambda self, t: None
    dev = torch.device("cuda", torch.cuda.current_device())
    mesh = hsdp.init_mesh(world, 1, "cuda")
    mp = hsdp.MixedPrecision(torch.bfloat16, torch.bfloat16)
    cfg = GPTConfig(vocab=256, hidden=512, heads=8, ffn=2048, layers=4, seq=64)
    params = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        for blk in model.blocks:
            hsdp.fully_shard(blk, mesh=mesh, mp_policy=mp, overlap_outer=overlap)
        hsdp.fully_shard(model, mesh=mesh, mp_policy=mp, overlap_outer=overlap)
        emulate(model, Fabric(outer=Link(1.0)), dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            gen = torch.Generator(dev).manual_seed(100 * step + rank)
            tokens = torch.randint(0, cfg.vocab, (4, cfg.seq), device=dev, generator=gen)
            lm_loss(model(tokens), tokens).backward()
            opt.step()
            opt.zero_grad()
        params[overlap] = [v.cpu() for v in hsdp.full_state_dict(model).values()]
    return {"equal": all(torch.equal(a, b) for a, b in zip(params[True], params[False]))}
