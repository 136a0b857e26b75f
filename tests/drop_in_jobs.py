"""Multi-rank jobs for the FSDP2-style options (tests/dist/test_drop_in.py): each case trains a
small GPT on a 2x2 gloo mesh with one option in use and reports its relative error against
a single-process reference (same data split as tests/parity_jobs.py)."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import hsdp
from hsdp.sharding.group import owner
from hsdp_tools.models import GPT, GPTConfig, lm_loss

ROWS_PER_RANK = 2
STEPS = 3
LR, MOMENTUM = 0.1, 0.9
COMPILE = {"backend": "aot_eager", "fullgraph": True}

# Called before each microbatch's forward: (model, step, micro, n_micro) -> the context the
# microbatch runs in (hsdp only; the reference runs plainly).
MicroFn = Callable[[nn.Module, int, int, int], AbstractContextManager]


def _default_micro(model: nn.Module, step: int, m: int, n: int) -> AbstractContextManager:
    return hsdp.microbatch(model, is_last=m == n - 1)


def _tokens(step: int, micro: int, world: int, cfg: GPTConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, cfg.vocab, (world * ROWS_PER_RANK, cfg.seq), generator=g)


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k].float() - b[k].float()).norm()
                / b[k].float().norm().clamp_min(1e-12)).item() for k in a)


# How a step clears the gradients after optimizer.step().
CLEAR: dict[str, Callable[[torch.optim.Optimizer], None]] = {
    "none": lambda opt: opt.zero_grad(),
    "zeros": lambda opt: opt.zero_grad(set_to_none=False),
    "never": lambda opt: None,  # accumulate across steps, as torch does
}


def train(model: nn.Module, rank: int | None, world: int, cfg: GPTConfig, *,
          microbatches: int = 1, micro: MicroFn = _default_micro,
          opt: torch.optim.Optimizer | None = None, clear: str = "none") -> None:
    """STEPS steps of SGD-momentum; ``rank=None``: the reference (whole batch, no hsdp)."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        for m in range(microbatches):
            tokens = _tokens(step, m, world, cfg)
            ctx: AbstractContextManager = nullcontext()
            if rank is not None:
                tokens = tokens[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
                ctx = micro(model, step, m, microbatches)
            with ctx:
                (lm_loss(model(tokens), tokens) / microbatches).backward()
        opt.step()
        CLEAR[clear](opt)


def _shard(model: GPT, mesh, **kwargs) -> GPT:
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, **kwargs)
    return hsdp.fully_shard(model, mesh=mesh, **kwargs)


def _pair(cfg: GPTConfig) -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    ref = GPT(cfg)
    return ref, copy.deepcopy(ref)


def _reference(cfg: GPTConfig, world: int, microbatches: int = 1,
               clear: str = "none") -> dict[str, torch.Tensor]:
    ref, _ = _pair(cfg)
    train(ref, None, world, cfg, microbatches=microbatches, clear=clear)
    return {k: v.detach() for k, v in ref.state_dict().items()}


# --------------------------------------------------------------------------- cases


def case_compile(rank: int, world: int, mesh, mode: str) -> dict[str, float]:
    """Blocks compiled (aot_eager, fullgraph) as ``torch.compile(block)`` before
    fully_shard or ``block.compile()`` after it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = GPTConfig()
    _, model = _pair(cfg)
    for i, blk in enumerate(model.blocks):
        if mode == "wrap_before":
            model.blocks[i] = blk = torch.compile(blk, **COMPILE)
        hsdp.fully_shard(blk, mesh=mesh)
        if mode == "method_after":
            blk.compile(**COMPILE)
    hsdp.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    train(model, rank, world, cfg, microbatches=2, opt=opt)
    ref = _reference(cfg, world, 2)
    # The keys have no "_orig_mod." (rel_err compares them): checkpoints move between
    # compiled and plain models.
    out = {"ref": rel_err(hsdp.full_state_dict(model), ref),
           "graph_breaks": sum(counters["graph_break"].values()),
           "graphs": counters["stats"]["unique_graphs"],
           "keys": _compiled_keys(model, opt, ref, mesh)}
    return out


def _compiled_keys(model: nn.Module, opt: torch.optim.Optimizer,
                   ref: dict[str, torch.Tensor], mesh) -> float:
    """Keys of get_state_dict, a save of the compiled model loaded into a plain one, and
    load_full_state_dict of a plain state dict: max relative error (inf on a key mismatch)."""
    model_sd, optim_sd = hsdp.get_state_dict(model, opt)
    if not (model_sd.keys() == ref.keys() == optim_sd["state"].keys()):
        return float("inf")
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    ckpt = os.path.join(path[0], "ckpt")
    hsdp.save(ckpt, model, opt)
    _, plain = _pair(GPTConfig())
    _shard(plain, mesh)
    hsdp.load(ckpt, plain, torch.optim.SGD(plain.parameters(), lr=LR, momentum=MOMENTUM))
    err = rel_err(hsdp.full_state_dict(plain), ref)
    hsdp.load_full_state_dict(model, hsdp.full_state_dict(_pair(GPTConfig())[0]))
    return max(err, rel_err(hsdp.full_state_dict(model), _pair(GPTConfig())[0].state_dict()))


def case_accumulate(rank: int, world: int, mesh, strategy: str,
                    clear: str) -> dict[str, float]:
    """Two plain backward passes per step (no hsdp.microbatch) accumulate as in torch, and
    so do gradients left set across steps (``clear``: see CLEAR)."""
    cfg = GPTConfig()
    _, model = _pair(cfg)
    _shard(model, mesh, strategy=strategy)
    train(model, rank, world, cfg, microbatches=2, micro=lambda *_: nullcontext(),
          clear=clear)
    return {"ref": rel_err(hsdp.full_state_dict(model), _reference(cfg, world, 2, clear))}


def case_full_tensor(rank: int, world: int, mesh, strategy: str) -> dict[str, object]:
    """full_tensor() / redistribute(Replicate) of parameters, their .grad and optimizer
    state against the reference's tensors, with torch's clip_grad_norm_ in the loop;
    other redistributions and a differentiable full_tensor() raise hsdp's error."""
    cfg = GPTConfig()
    ref, model = _pair(cfg)
    _shard(model, mesh, strategy=strategy)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (ref, model)]
    errs: dict[str, float] = {"param": 0.0, "grad": 0.0, "momentum": 0.0, "replicate": 0.0}

    def err(kind: str, mine: torch.Tensor, theirs: torch.Tensor) -> None:
        e = ((mine - theirs).norm() / theirs.norm().clamp_min(1e-12)).item()
        errs[kind] = max(errs[kind], e)

    named = list(zip(ref.parameters(), model.parameters()))
    for step in range(STEPS):
        tokens = _tokens(step, 0, world, cfg)
        lm_loss(ref(tokens), tokens).backward()
        mine = tokens[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
        lm_loss(model(mine), mine).backward()
        for m in (ref, model):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        for r, p in named:
            err("grad", p.grad.full_tensor(), r.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            for r, p in named:
                err("param", p.full_tensor(), r)
                rep = p.redistribute(placements=[Replicate(), Replicate()])
                err("replicate", rep.to_local(), r)
                err("momentum", opts[1].state[p]["momentum_buffer"].full_tensor(),
                    opts[0].state[r]["momentum_buffer"])
    # torch's own full state dict gathers through full_tensor() too.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    torch_full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    errs["torch_full"] = rel_err(torch_full, hsdp.full_state_dict(model))
    p = model.blocks[0].fc1.weight
    refused = []
    for call in (lambda: p.full_tensor(),
                 lambda: p.detach().redistribute(placements=[Shard(0), Shard(0)])):
        try:
            call()
        except RuntimeError as e:
            refused.append(str(e).startswith("hsdp: "))
    return {**errs, "refused": refused}


def case_mixed_precision(rank: int, world: int, mesh) -> dict[str, float]:
    """fp32 root, bf16 blocks fed fp32 activations: cast_forward_inputs and output_dtype,
    against the reference and FSDP2 with the same policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    cfg = GPTConfig()
    _, model = _pair(cfg)
    fsdp2 = copy.deepcopy(model)
    mp = hsdp.MixedPrecision(torch.bfloat16, torch.float32, output_dtype=torch.float32)
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, mp_policy=mp)
    hsdp.fully_shard(model, mesh=mesh)
    dtypes = []
    model.blocks[0].register_forward_hook(lambda m, a, o: dtypes.append((a[0].dtype, o.dtype)))
    train(model, rank, world, cfg)

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, output_dtype=torch.float32)
    for blk in fsdp2.blocks:
        fsdp2_shard(blk, mesh=mesh, mp_policy=policy)
    fsdp2_shard(fsdp2, mesh=mesh)

    def fsdp2_micro(m: nn.Module, step: int, i: int, n: int) -> AbstractContextManager:
        return nullcontext()

    train(fsdp2, rank, world, cfg, micro=fsdp2_micro)
    f2 = {k: v.full_tensor().detach() for k, v in fsdp2.state_dict().items()}
    mine = hsdp.full_state_dict(model)
    return {"ref": rel_err(mine, _reference(cfg, world)), "fsdp2": rel_err(mine, f2),
            "dtypes_ok": all(d == (torch.bfloat16, torch.float32) for d in dtypes)}


def case_reshard_after_forward(rank: int, world: int, mesh) -> dict[str, float]:
    """Blocks keep their gathered parameters from forward to backward."""
    cfg = GPTConfig()
    _, model = _pair(cfg)
    _shard(model, mesh, reshard_after_forward=False)
    model.blocks[1].set_reshard_after_forward(True)  # mixed, per unit
    gathered = []

    def after_forward(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
        model._hsdp_unit.runtime.synchronize()  # frees run on the all-gather stream
        gathered.append([g.buffers.gathered.untyped_storage().nbytes() > 0
                         for b in model.blocks for g in b._hsdp_unit.groups])

    model.register_forward_hook(after_forward)
    train(model, rank, world, cfg, microbatches=2)
    return {"ref": rel_err(hsdp.full_state_dict(model), _reference(cfg, world, 2)),
            "kept_ok": all(k == [True, False, True] for k in gathered)}


def case_no_sync(rank: int, world: int, mesh, strategy: str) -> dict[str, float]:
    """Microbatches 0-1 without gradient sync, 2 synced but not last, 3 last; on the second
    step only the last one syncs (FSDP2's usual pattern)."""
    cfg = GPTConfig()
    _, model = _pair(cfg)
    _shard(model, mesh, strategy=strategy)
    tracer = model._hsdp_unit.tracer
    comms_without_sync = []

    def micro(m: nn.Module, step: int, i: int, n: int) -> AbstractContextManager:
        sync = i >= 2 if step == 0 else i == n - 1
        m.set_requires_gradient_sync(sync)
        if not sync:
            return _traced_backward(tracer, comms_without_sync)
        return hsdp.microbatch(m, is_last=i == n - 1)

    train(model, rank, world, cfg, microbatches=4, micro=micro)
    return {"ref": rel_err(hsdp.full_state_dict(model), _reference(cfg, world, 4)),
            "comms_without_sync": len(comms_without_sync)}


class _traced_backward(AbstractContextManager):
    """Collects the reduce ops hsdp's streams ran during the block (after draining)."""

    def __init__(self, tracer, out: list) -> None:
        self.tracer, self.out = tracer, out

    def __enter__(self) -> None:
        self.tracer.take()
        self.tracer.enabled = True

    def __exit__(self, *exc) -> None:
        self.tracer.enabled = False
        self.out.extend(r.label for r in self.tracer.take()
                        if r.label.split(":")[0] in ("RS", "OUTER_AR", "OUTER_RS"))


def case_unshard_prefetch(rank: int, world: int, mesh) -> dict[str, float]:
    """Explicit prefetch lists and an explicit async unshard of the first block before
    each forward; unshard() shows the full parameters."""
    cfg = GPTConfig()
    _, model = _pair(cfg)
    _shard(model, mesh)
    b = model.blocks
    b[0].set_modules_to_forward_prefetch([b[1], b[2]])
    b[2].set_modules_to_backward_prefetch([b[1], b[0]])

    def micro(m: nn.Module, step: int, i: int, n: int) -> AbstractContextManager:
        b[0].unshard(async_op=True)
        return hsdp.microbatch(m, is_last=i == n - 1)

    train(model, rank, world, cfg, microbatches=2, micro=micro)
    full = hsdp.full_state_dict(model)
    b[1].unshard()
    shown = b[1].fc1.weight.detach().clone()
    b[1].reshard()
    return {"ref": rel_err(full, _reference(cfg, world, 2)),
            "shown": rel_err({"w": shown}, {"w": full["blocks.1.fc1.weight"]}),
            "resharded": owner(b[1].fc1.weight) is not None}


def case_freeze(rank: int, world: int, mesh, strategy: str) -> dict[str, float]:
    """requires_grad_ changes after fully_shard, the same on the reference: step 1 freezes
    the embedding (one parameter of the root's group) and block 1 (whole groups), step 2
    unfreezes block 1; hsdp also unfreezes block 2, frozen when fully_shard ran. SGD with
    weight decay: a zero gradient would still move a frozen weight."""
    cfg = GPTConfig()
    ref, model = _pair(cfg)
    late = strategy == "hsdp"  # hfsdp refuses it (tests/dist/test_errors.py)
    for m in (ref, model):
        m.blocks[2].requires_grad_(not late)
    _shard(model, mesh, strategy=strategy)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=0.01)
            for m in (ref, model)]
    block1 = model.blocks[1]._hsdp_unit.label
    norms, reduced_frozen = [], []
    for step in range(STEPS):
        for m in (ref, model):
            if step == 1:
                m.embed.weight.requires_grad_(False)
                m.blocks[1].requires_grad_(False)
                m.blocks[2].requires_grad_(True)
            if step == 2:
                m.blocks[1].requires_grad_(True)
        tokens = _tokens(step, 0, world, cfg)
        lm_loss(ref(tokens), tokens).backward()
        mine = tokens[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
        tracer = model._hsdp_unit.tracer
        with _traced_backward(tracer, reduced_frozen) if step == 1 else nullcontext():
            lm_loss(model(mine), mine).backward()
        reduced_frozen[:] = [op for op in reduced_frozen
                             if op.split(":")[1].split("/")[0] == block1]
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        n_mine = hsdp.clip_grad_norm_(model, 1e9)
        norms.append(abs(n_ref.item() - n_mine.item()) / n_ref.item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {"ref": rel_err(hsdp.full_state_dict(model),
                           {k: v.detach() for k, v in ref.state_dict().items()}),
            "norm": max(norms), "reduced_frozen": len(reduced_frozen)}


class _Nested(nn.Module):
    """A unit whose own modules come both before and after a nested unit's."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.inner = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.last = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.inner(self.first(x)))


def case_materialize(rank: int, world: int, mesh, strategy: str) -> dict[str, float]:
    """Meta init of nested units (the walk leaves a unit and comes back to it: its values
    so far are all-gathered), then training, against a normal build under the same seed."""
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight)
            nn.init.uniform_(m.bias)

    def build() -> nn.Sequential:
        return nn.Sequential(_Nested(), nn.Linear(3, 2))

    ref = build()
    torch.manual_seed(5)
    for m in ref.modules():
        init(m)
    with torch.device("meta"):
        model = build()
    hsdp.fully_shard(model[0].inner, mesh=mesh, strategy=strategy)
    hsdp.fully_shard(model[0], mesh=mesh, strategy=strategy)
    hsdp.fully_shard(model, mesh=mesh, strategy=strategy)
    torch.manual_seed(5)
    hsdp.materialize(model, init)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    init_err = rel_err(hsdp.full_state_dict(model), state)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (ref, model)]
    for step in range(STEPS):
        x = torch.randn(world * ROWS_PER_RANK, 4, generator=torch.Generator().manual_seed(step))
        ref(x).square().mean().backward()
        model(x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {"init": init_err, "ref": rel_err(hsdp.full_state_dict(model),
                                             {k: v.detach() for k, v in ref.state_dict().items()})}


def drop_in_job(rank: int, world: int, cases: list[tuple]) -> dict[tuple, dict]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    out = {}
    for case in cases:
        out[case] = globals()[f"case_{case[0]}"](rank, world, mesh, *case[1:])
    return out


def transformers_job(rank: int, world: int) -> dict[str, float]:
    """A transformers LlamaForCausalLM the way the example builds its own model: meta
    device, fully_shard per decoder layer, hsdp.materialize with the model's own
    ``_init_weights``; trained against the same model built and initialized normally."""
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore")
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    ref = LlamaForCausalLM(cfg)
    for p in ref.parameters():  # a normal build marks them initialized
        p.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(3)
    for m in ref.modules():
        ref._init_weights(m)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        hsdp.fully_shard(layer, mesh=mesh)
    hsdp.fully_shard(model, mesh=mesh)
    torch.manual_seed(3)
    hsdp.materialize(model, model._init_weights)
    def ref_state() -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in ref.state_dict().items()}

    init_err = rel_err(hsdp.full_state_dict(model), ref_state())
    # The rotary tables are non-persistent buffers (not in state dicts): init set them too.
    init_err += sum((a - b).abs().sum().item() for a, b in zip(model.buffers(), ref.buffers()))
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (ref, model)]
    losses = []
    g = torch.Generator().manual_seed(0)  # one batch, learnt step by step
    ids = torch.randint(0, cfg.vocab_size, (world * ROWS_PER_RANK, 12), generator=g)
    for _ in range(STEPS):
        mine = ids[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        model(input_ids=mine, labels=mine).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(ref_loss.item())
    return {"init": init_err, "ref": rel_err(hsdp.full_state_dict(model), ref_state()),
            "loss_moved": losses[-1] < losses[0]}
