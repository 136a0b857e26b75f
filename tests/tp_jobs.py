"""Tensor parallelism inside hsdp units: a tiny Llama-style model with torchtitan's TP plan on
an (outer, inner, tp) mesh, compared with one process and with FSDP2 + the same TP plan.

Data: DP rank d = o * inner + i (the tp ranks of one (o, i) see the same rows) takes rows
[d*b, (d+1)*b) of each global microbatch of ROWS rows (b = ROWS / DP ranks); its loss is
the mean over its rows divided by the number of microbatches, so the mean of the DP ranks'
gradients is the reference's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import hsdp

VOCAB, DIM, HEADS, FFN, SEQ, LAYERS = 32, 16, 8, 32, 9, 2  # inputs: SEQ - 1 = 8 tokens
ROWS = 8  # global batch: every DP size up to 8 gets whole rows
STEPS = 3
LR, MOMENTUM = 0.1, 0.9
CLIP = 0.05  # below every gradient norm of these runs: clipping is active
# frozen in TPCase(frozen=True): a rowwise (Shard(1)) embedding, a colwise (Shard(0)) weight
# and a sequence-parallel (Replicate) norm weight
FROZEN = ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.1.ffn_norm.weight")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads this rank holds (all of them without TP, HEADS / tp with it)
        q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():  # norm weights away from 1: their gradients matter
            for m in self.modules():
                if isinstance(m, nn.RMSNorm):
                    m.weight.uniform_(0.5, 1.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def apply_tp(model: Llama, tp_mesh: DeviceMesh) -> None:
    """torchtitan's Llama TP plan (sequence-parallel norms, no loss parallel)."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


@dataclass(frozen=True)
class TPCase:
    strategy: str = "hsdp"  # "hsdp", "hfsdp", or "fsdp2" (torch's FSDP2 HSDP + TP)
    overlap: bool = True
    microbatches: int = 1
    clip: str = ""  # "torch-2" / "hsdp-inf" ...: clip_grad_norm_ (whose, norm type) each step
    bf16: bool = False  # bf16 parameters for compute, fp32 reduction
    ac: bool = False  # blocks in torch's checkpoint_wrapper (after TP, as torchtitan)
    compile: bool = False  # block.compile(backend="aot_eager") after TP (and AC)
    frozen: bool = False  # FROZEN parameters do not train
    meta: bool = False  # built on meta, TP on meta, then hsdp.materialize(init_modules)
    outer_reduce: str = ""  # "int8": the compressed outer reduction (block 16)

    @property
    def ref_key(self) -> tuple:
        """What the one-process reference depends on."""
        return self.microbatches, self.clip, self.frozen, self.meta


def init_module(m: nn.Module) -> None:
    """Each module's own initializer (``materialize``'s init_fn)."""
    if isinstance(m, nn.RMSNorm):
        m.weight.uniform_(0.5, 1.5)
    elif isinstance(m, (nn.Linear, nn.Embedding)):
        m.reset_parameters()


def reference(case: TPCase) -> Llama:
    """The one-process model of ``case``'s initial values and frozen parameters."""
    torch.manual_seed(0)
    model = Llama()
    if case.meta:  # what materialize gives: init_module over modules() under seed 0
        torch.manual_seed(0)
        with torch.no_grad():
            for m in model.modules():
                init_module(m)
    freeze(model, case)
    return model


def freeze(model: nn.Module, case: TPCase) -> None:
    if case.frozen:
        for name, p in model.named_parameters():
            if name in FROZEN:
                p.requires_grad_(False)


def _tokens(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _clip(model: nn.Module, clip: str, runner: str) -> float:
    """Clip with torch's clip_grad_norm_ (the reference always does) or hsdp's; the total
    norm before clipping."""
    who, norm_type = clip.split("-")
    if who == "hsdp" and runner == "hsdp":
        return hsdp.clip_grad_norm_(model, CLIP, float(norm_type)).item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, float(norm_type))
    return norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def train(model: nn.Module, runner: str, microbatches: int, dp_rank: int, dp: int,
          opt: torch.optim.Optimizer, steps: range = range(STEPS),
          clip: str = "") -> list[float]:
    """SGD with momentum. runner: "ref" (the whole batch), "hsdp", "fsdp2". Returns the
    gradient norms clipping saw (with ``clip``)."""
    rows = ROWS // dp
    norms = []
    for step in steps:
        for m in range(microbatches):
            tokens = _tokens(step, m)
            if runner != "ref":
                tokens = tokens[dp_rank * rows:(dp_rank + 1) * rows]
            last = m == microbatches - 1
            if runner == "hsdp":
                with hsdp.microbatch(model, is_last=last):
                    (_loss(model, tokens) / microbatches).backward()
            else:
                if runner == "fsdp2":
                    model.set_requires_all_reduce(last, recurse=True)
                (_loss(model, tokens) / microbatches).backward()
        if clip:
            norms.append(_clip(model, clip, runner))
        opt.step()
        opt.zero_grad()
    return norms


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (over DP and TP shards), on CPU, by its name in ``Llama``
    (without checkpoint_wrapper's part)."""
    with torch.no_grad():
        return {k.replace("._checkpoint_wrapped_module", ""):
                (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
                for k, v in model.named_parameters()}


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in a)


def sharded_model(mesh: DeviceMesh, case: TPCase) -> Llama:
    """The reference's initial model with the TP plan on mesh["tp"], then data-parallel
    sharding by hsdp (every block, then the root) or by FSDP2 on mesh["outer", "inner"]."""
    torch.manual_seed(0)
    with torch.device("meta" if case.meta else "cpu"):
        model = Llama()
    apply_tp(model, mesh["tp"])
    freeze(model, case)
    for i, block in enumerate(model.layers):
        if case.ac:
            model.layers[i] = block = checkpoint_wrapper(block)
        if case.compile:
            block.compile(backend="aot_eager")
    dtypes = (torch.bfloat16, torch.float32) if case.bf16 else (None, None)
    if case.strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        for module in (*model.layers, model):
            fully_shard(module, mesh=mesh["outer", "inner"],
                        mp_policy=MixedPrecisionPolicy(*dtypes))
        return model
    for module in (*model.layers, model):
        hsdp.fully_shard(module, mesh=mesh, strategy=case.strategy, overlap_outer=case.overlap,
                         mp_policy=hsdp.MixedPrecision(*dtypes) if case.bf16 else None,
                         outer_reduce=hsdp.OuterReduce(case.outer_reduce, block=16)
                         if case.outer_reduce else None)
    if case.meta:
        torch.manual_seed(0)
        hsdp.materialize(model, init_module)
    return model


def mesh_errors() -> list[str]:
    """init_mesh's errors for sizes that do not fit the world (8 ranks) or are not sizes."""
    out = []
    for sizes in ((3, 1, 2), (2, 2, 3), (2, 2, 0), (1, 2, 2)):
        try:
            hsdp.init_mesh(*sizes[:2], "cpu", tp=sizes[2])
            out.append(f"{sizes}: no error")
        except ValueError as e:
            out.append(str(e))
    return out


def parity_job(rank: int, world: int, shape: tuple[int, int, int],
               cases: list[TPCase]) -> dict:
    """For each case: relative error of the trained parameters against one process, and
    hsdp's against FSDP2 + TP (same microbatches). Also "mesh": the mesh's dims and ranks,
    and "errors": ``mesh_errors()``."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    outer, inner, tp = shape
    mesh = hsdp.init_mesh(outer, inner, "cpu", tp=tp)
    out: dict = {"mesh": (mesh.mesh_dim_names, mesh.mesh.tolist(), mesh["tp"].mesh.tolist()),
                 "errors": mesh_errors()}
    dp_rank = rank // tp
    refs: dict[tuple, tuple[dict[str, torch.Tensor], list[float]]] = {}
    fsdp2: dict[tuple[int, bool, bool], dict[str, torch.Tensor]] = {}
    for case in cases:
        M = case.microbatches
        if case.ref_key not in refs:
            ref = reference(case)
            norms = train(ref, "ref", M, 0, 1, optimizer(ref), clip=case.clip)
            refs[case.ref_key] = ({k: v.detach().clone() for k, v in ref.named_parameters()},
                                  norms)
        model = sharded_model(mesh, case)
        norms = train(model, "fsdp2" if case.strategy == "fsdp2" else "hsdp", M, dp_rank,
                      outer * inner, optimizer(model), clip=case.clip)
        if case.strategy != "fsdp2":
            hsdp.synchronize(model)
        got = full_params(model)
        ref_params, ref_norms = refs[case.ref_key]
        errs = {"ref": rel_err(got, ref_params)}
        if case.clip:  # clipping was active: the norms exceed the bound
            errs["norm"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
            errs["clipped"] = min(ref_norms) > CLIP
        key = M, case.bf16, case.compile
        if case.strategy == "fsdp2":
            fsdp2[key] = got
        elif key in fsdp2 and case.ref_key == (M, "", False, False):
            errs["fsdp2"] = rel_err(got, fsdp2[key])
        out[case] = errs
    return out


def _refused(build, mesh: DeviceMesh) -> str:
    """fully_shard of ``build()``'s module on ``mesh``: the error, which must leave the
    module as it was."""
    module = build()
    before = dict(module.named_parameters())
    try:
        hsdp.fully_shard(module, mesh=mesh)
    except ValueError as e:
        unchanged = (type(module) is nn.Linear and dict(module.named_parameters()) == before)
        return str(e) if unchanged else f"changed: {e}"
    return "no error"


def errors_job(rank: int, world: int) -> dict[str, str]:
    """What fully_shard refuses on TP parameters, each before anything changes."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import _StridedShard
    mesh = hsdp.init_mesh(2, 2, "cpu", tp=2)
    mesh_2d = hsdp.init_mesh(2, 4, device_type="cpu")

    def linear_on(sub: DeviceMesh) -> nn.Module:
        torch.manual_seed(0)
        module = nn.Linear(4, 4, bias=False)
        parallelize_module(module, sub, ColwiseParallel())
        return module

    def with_placement(placement) -> nn.Module:
        module = nn.Linear(4, 4, bias=False)
        module.weight = nn.Parameter(DTensor.from_local(torch.randn(2, 4), mesh["tp"],
                                                        [placement], run_check=False))
        return module

    return {"2d": _refused(lambda: linear_on(mesh["tp"]), mesh_2d),
            "not_tp": _refused(lambda: linear_on(mesh["inner"]), mesh),
            "strided": _refused(lambda: with_placement(_StridedShard(0, split_factor=2)), mesh),
            "partial": _refused(lambda: with_placement(Partial()), mesh)}


CKPT_TARGETS = ((1, 4, 2, "hfsdp"), (2, 4, 1, "hsdp"), (1, 1, 8, "hsdp"))
MORE = range(STEPS, STEPS + 2)  # the steps after the checkpoint


def checkpoint_job(rank: int, world: int, path: str) -> dict[str, float]:
    """Save on (2, 2, 2) after STEPS steps; load on each of CKPT_TARGETS (outer, inner, tp
    (1: a 2-D mesh, no TP plan), strategy) and train two more steps: relative error
    against one process trained STEPS + 2 steps. Also hsdp.full_state_dict on (2, 2, 2)
    against one process after STEPS steps."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    ref = Llama()
    opt = optimizer(ref)
    train(ref, "ref", 1, 0, 1, opt)
    at_save = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    train(ref, "ref", 1, 0, 1, opt, MORE)
    final = {k: v.detach().clone() for k, v in ref.named_parameters()}

    mesh = hsdp.init_mesh(2, 2, "cpu", tp=2)
    model = sharded_model(mesh, TPCase("hsdp"))
    opt = optimizer(model)
    train(model, "hsdp", 1, rank // 2, 4, opt)
    out = {"full_state_dict": rel_err(hsdp.full_state_dict(model), at_save)}
    hsdp.save(path, model, opt)
    hsdp.synchronize(model)
    for outer, inner, tp, strategy in CKPT_TARGETS:
        target = hsdp.init_mesh(outer, inner, "cpu", tp=tp)
        torch.manual_seed(1)  # other initial values: the checkpoint must replace them
        model = Llama()
        if tp > 1:
            apply_tp(model, target["tp"])
        for block in model.layers:
            hsdp.fully_shard(block, mesh=target, strategy=strategy)
        hsdp.fully_shard(model, mesh=target, strategy=strategy)
        opt = optimizer(model)
        hsdp.load(path, model, opt)
        train(model, "hsdp", 1, rank // tp, outer * inner, opt, MORE)
        hsdp.synchronize(model)
        out[f"{outer}x{inner}x{tp}"] = rel_err(full_params(model), final)
    return out
