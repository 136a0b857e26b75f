"""Float8 training (torchao, emulated on CPU) under hsdp, compared with one process and
with torch FSDP2 + torchao on the same 2x2 mesh.

Float8 scales each forward's input (and each backward's output gradient) by its own
amax, so the single-process reference forwards each rank's rows separately (loss
divided by world x microbatches, gradients accumulated): the data-parallel run is then
the same computation, element by element.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

import hsdp
from hsdp.sharding.comm import Collectives
from hsdp_tools.models import Llama, LlamaConfig, lm_loss

ROWS_PER_RANK = 2
STEPS = 5
LR, MOMENTUM = 0.1, 0.9
EDIT_AFTER = 1
CFG = dict(vocab=37, hidden=32, heads=4, kv_heads=2, ffn=48, layers=2, seq=8)


@dataclass(frozen=True)
class Case:
    strategy: str = "hsdp"
    float8_all_gather: bool = False
    microbatches: int = 1
    checkpoint: str = "none"
    bf16: bool = False  # compute in bf16 (MixedPrecision / MixedPrecisionPolicy)
    compile: bool = False  # torch.compile each block (aot_eager)
    edit: bool = False  # the float8 weights are scaled by hand after step EDIT_AFTER
    meta: bool = False  # built on the meta device, initialized by hsdp.materialize
    recipe: str = "tensorwise"  # torchao's recipe; "rowwise": no float8 all-gather
    outer_reduce: str = ""  # "int8": the compressed outer reduction (block 16)


class Recorder(Collectives):
    """hsdp's collectives, counting the bytes each all-gather moves per mesh axis."""

    def __init__(self) -> None:
        super().__init__()
        self.all_gather_bytes = {"inner": 0, "outer": 0}

    def before(self, kind: str, axis: str, nbytes: int, group_size: int) -> None:
        if kind == "all_gather":
            self.all_gather_bytes[axis] += nbytes


def init_fn(m: nn.Module) -> None:
    """What meta cases initialize with (hsdp.materialize; the references run it over
    ``modules()`` in order, after the same seed)."""
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.1)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight)
    elif isinstance(m, nn.RMSNorm):
        nn.init.ones_(m.weight)


def float8_model(case: Case, device: str = "cpu") -> nn.Module:
    """The Llama of CFG with its linears in float8 (``case.recipe``, emulated), but for
    those whose dims are not multiples of 16 (the head, vocab 37), as torchao's recipes
    leave them. Meta cases: initialized by ``init_fn`` (on the meta device: not yet)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(LlamaConfig(**CFG, checkpoint=case.checkpoint))
    if case.recipe == "tensorwise":
        config = Float8LinearConfig(emulate=True,
                                    enable_fsdp_float8_all_gather=case.float8_all_gather)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(case.recipe),
                                     emulate=True)
    model = convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda m, _: m.in_features % 16 == 0 and m.out_features % 16 == 0)
    if case.meta and device != "meta":
        torch.manual_seed(1)
        with torch.no_grad():
            for m in model.modules():
                init_fn(m)
    return model


def _tokens(step: int, micro: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, CFG["vocab"], (world * ROWS_PER_RANK, CFG["seq"]), generator=g)


def _rows(tokens: torch.Tensor, r: int) -> torch.Tensor:
    return tokens[r * ROWS_PER_RANK:(r + 1) * ROWS_PER_RANK]


def _edit(model: nn.Module, rank: int, world: int, case: Case, kind: str) -> str:
    """Scale the float8 weights by hand (as a checkpoint load would change them) and
    make the scales follow: hsdp first refuses to gather them with the old scales (the
    error is returned), then hsdp.precompute_float8_scales; FSDP2: torchao's
    precompute (which nothing would force)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Float8Linear":
                m.weight.mul_(3.0)
    refused = ""
    if kind == "hsdp":
        x = _rows(_tokens(99, 0, world), rank)
        try:
            model(x)
        except RuntimeError as exc:
            refused = str(exc)
        hsdp.precompute_float8_scales(model)
    elif kind == "fsdp2" and case.float8_all_gather:
        precompute_float8_dynamic_scale_for_fsdp(model)
    return refused


def _train(model: nn.Module, rank: int, world: int, case: Case, kind: str) -> str:
    """STEPS steps of SGD with momentum. kind: "ref" (one process, every rank's rows
    forwarded separately), "hsdp" or "fsdp2". Returns hsdp's refusal of stale scales
    (edit cases)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    M = case.microbatches
    refused = ""
    for step in range(STEPS):
        for m in range(M):
            tokens = _tokens(step, m, world)
            last = m == M - 1
            if kind == "ref":
                for r in range(world):
                    x = _rows(tokens, r)
                    (lm_loss(model(x), x) / (M * world)).backward()
                continue
            x = _rows(tokens, rank)
            if kind == "hsdp":
                with hsdp.microbatch(model, is_last=last):
                    (lm_loss(model(x), x) / M).backward()
            else:
                model.set_requires_all_reduce(last, recurse=True)
                (lm_loss(model(x), x) / M).backward()
        opt.step()
        opt.zero_grad()
        if kind == "fsdp2" and case.float8_all_gather:
            precompute_float8_dynamic_scale_for_fsdp(model)
        if case.edit and step == EDIT_AFTER:
            refused = _edit(model, rank, world, case, kind)
    return refused


def _rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k].float() - b[k].float()).norm()
                / b[k].float().norm().clamp_min(1e-12)).item() for k in a)


def _plain(state: dict) -> dict[str, torch.Tensor]:
    """A state dict's values as plain full tensors (DTensors gathered, torchao's weight
    wrapper unwrapped)."""
    out = {}
    for k, v in state.items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = getattr(v, "_tensor", v).detach().clone()
    return out


def float8_job(rank: int, world: int, cases: list[Case]) -> dict[Case, dict]:
    """For each case: relative error of hsdp's parameters after STEPS steps against the
    single-process run and against FSDP2 + torchao (same config, same mesh), FSDP2's
    against the single process, the bytes hsdp's all-gathers moved per axis, and the
    number of float8 weight elements."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    refs: dict[tuple, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
    out = {}
    for case in cases:
        key = (case.float8_all_gather, case.microbatches, case.checkpoint, case.bf16,
               case.edit, case.meta, case.recipe)
        if key not in refs:
            ref = float8_model(case)
            if not case.bf16:  # one process has no bf16 weight copies to compute with
                _train(ref, rank, world, case, "ref")
            f2 = float8_model(case)
            policy = MixedPrecisionPolicy(torch.bfloat16 if case.bf16 else None)
            for blk in f2.blocks:
                fsdp2_shard(blk, mesh=mesh, mp_policy=policy)
            fsdp2_shard(f2, mesh=mesh, mp_policy=policy)
            _train(f2, rank, world, case, "fsdp2")
            refs[key] = _plain(ref.state_dict()), _plain(f2.state_dict())
        ref_state, f2_state = refs[key]
        model = float8_model(case, "meta" if case.meta else "cpu")
        float8_numel = sum(m.weight.numel() for m in model.modules()
                           if type(m).__name__ == "Float8Linear")
        mp = hsdp.MixedPrecision(torch.bfloat16) if case.bf16 else None
        outer = hsdp.OuterReduce(case.outer_reduce, block=16) if case.outer_reduce else None
        for blk in model.blocks:
            hsdp.fully_shard(blk, mesh=mesh, strategy=case.strategy, mp_policy=mp,
                             outer_reduce=outer)
            if case.compile:
                blk.compile(backend="aot_eager", fullgraph=True)
        hsdp.fully_shard(model, mesh=mesh, strategy=case.strategy, mp_policy=mp,
                         outer_reduce=outer)
        if case.meta:
            torch.manual_seed(1)
            hsdp.materialize(model, init_fn)
        recorder = model._hsdp_unit.collectives = Recorder()
        refused = _train(model, rank, world, case, "hsdp")
        state = _plain(hsdp.full_state_dict(model))
        out[case] = {"ref": _rel_err(state, ref_state), "fsdp2": _rel_err(state, f2_state),
                     "fsdp2_vs_ref": _rel_err(f2_state, ref_state),
                     "all_gather_bytes": recorder.all_gather_bytes,
                     "float8_numel": float8_numel, "refused": refused}
    return out
