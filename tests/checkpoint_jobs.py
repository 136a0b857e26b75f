"""Multi-rank checkpoint jobs: save, reshard on load, async and interrupted saves, errors.

Training follows parity_jobs: rank r takes rows [r*b, (r+1)*b) of each global batch; the
single-process reference trains on the whole batch with the same optimizer.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from parity_jobs import ROWS_PER_RANK, _batches, _rel_err
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hsdp
import hsdp.sharding.comm
from hsdp.sharding.group import owner
from hsdp_tools.models import GPT, GPTConfig, lm_loss

K = 2  # steps before the save, and again after the load
_MESHES: dict = {}


@dataclass(frozen=True)
class Side:
    outer: int
    inner: int
    strategy: str = "hsdp"
    mp: bool = False  # bf16 parameters, fp32 reduction

    def __str__(self) -> str:
        return f"{self.outer}x{self.inner}-{self.strategy}{'-bf16' if self.mp else ''}"


def _build(side: Side | None, seed: int, cfg: GPTConfig | None = None) -> nn.Module:
    torch.manual_seed(seed)
    model = GPT(cfg or GPTConfig())
    if side is None:
        return model
    mesh = _mesh(side.outer, side.inner)
    mp = hsdp.MixedPrecision(torch.bfloat16, torch.float32) if side.mp else None
    for blk in model.blocks:
        hsdp.fully_shard(blk, mesh=mesh, strategy=side.strategy, mp_policy=mp)
    return hsdp.fully_shard(model, mesh=mesh, strategy=side.strategy, mp_policy=mp)


def _mesh(outer: int, inner: int):
    if (outer, inner) not in _MESHES:
        _MESHES[outer, inner] = hsdp.init_mesh(outer, inner, "cpu")
    return _MESHES[outer, inner]


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int,
           world: int, rows: int = ROWS_PER_RANK) -> None:
    """This rank's ``rows`` rows of each global batch (sized for ``world`` ranks)."""
    for step in steps:
        tokens = _batches(step, 0, world, GPTConfig())[rank * rows:(rank + 1) * rows]
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


def _reference(kind: str, world: int) -> dict[str, torch.Tensor]:
    """2K uninterrupted single-process steps on ``world`` ranks' worth of rows."""
    ref = _build(None, 0)
    opt = _optimizer(ref, kind)
    for step in range(2 * K):
        tokens = _batches(step, 0, world, GPTConfig())
        lm_loss(ref(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


PAIRS = [  # (saved on, loaded on, optimizer)
    (Side(2, 2), Side(1, 4), "sgd"),
    (Side(2, 2), Side(4, 1, "hfsdp"), "sgd"),
    (Side(2, 2, "hfsdp"), Side(2, 2), "sgd"),
    (Side(2, 2, "hfsdp", mp=True), Side(1, 4, mp=True), "sgd"),
    (Side(2, 2), Side(2, 2), "sgd"),
    (Side(2, 2, "hfsdp"), Side(2, 2, "hfsdp"), "adamw"),
    (Side(1, 4, mp=True), Side(1, 4, mp=True), "adamw"),
]


def reshard_job(rank: int, world: int, root: str) -> dict[str, dict]:
    """For each pair: train K steps, save, load into a fresh model (other seed) on the other
    side, train K more; compare with the reference and, on the same side, with an
    uninterrupted hsdp run."""
    out = {}
    refs = {kind: _reference(kind, world) for kind in ("sgd", "adamw")}
    for src_side, dst_side, kind in PAIRS:
        name = f"{src_side}->{dst_side}-{kind}"
        src = _build(src_side, 0)
        opt = _optimizer(src, kind)
        _steps(src, opt, range(K), rank, world)
        hsdp.save(os.path.join(root, name), src, opt)
        dst = _build(dst_side, 1)
        dst_opt = _optimizer(dst, kind)
        hsdp.load(os.path.join(root, name), dst, dst_opt)
        _steps(dst, dst_opt, range(K, 2 * K), rank, world)
        got = hsdp.full_state_dict(dst)
        res = {"ref": _rel_err(got, refs[kind])}
        if src_side == dst_side:
            _steps(src, opt, range(K, 2 * K), rank, world)
            want = hsdp.full_state_dict(src)
            res["bitwise"] = all(torch.equal(got[k], want[k]) for k in want)
        out[name] = res
    return out


def save_8_job(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """8 ranks (2x4 hfsdp): K steps, save; returns the full state at the save."""
    model = _build(Side(2, 4, "hfsdp"), 0)
    opt = _optimizer(model, "sgd")
    _steps(model, opt, range(K), rank, world)
    hsdp.save(os.path.join(root, "from8"), model, opt)
    return hsdp.full_state_dict(model)


def load_from_8_job(rank: int, world: int, root: str) -> dict[str, float]:
    """4 ranks (2x2 hsdp): load the 8-rank checkpoint, then K steps of the 8-rank batch
    (each of the 4 ranks takes two ranks' rows): equals the uninterrupted reference."""
    model = _build(Side(2, 2), 1)
    opt = _optimizer(model, "sgd")
    hsdp.load(os.path.join(root, "from8"), model, opt)
    loaded = hsdp.full_state_dict(model)
    _steps(model, opt, range(K, 2 * K), rank, 8, rows=2 * ROWS_PER_RANK)
    return {"ref": _rel_err(hsdp.full_state_dict(model), _reference("sgd", 8)),
            "loaded": loaded}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def safety_job(rank: int, world: int, root: str) -> dict[str, object]:
    """Async save, a failed save, mismatch errors, and model.state_dict() with plain DCP."""
    out: dict[str, object] = {}
    side = Side(2, 2, "hfsdp")
    model = _build(side, 0)
    opt = _optimizer(model, "adamw")
    _steps(model, opt, range(K), rank, world)

    # Async: training goes on while the checkpoint is written; the checkpoint holds the
    # state at the save. A second save first waits for the first.
    at_save = hsdp.full_state_dict(model)
    first = hsdp.save(os.path.join(root, "async1"), model, opt, async_save=True)
    _steps(model, opt, range(K, K + 1), rank, world)
    second = hsdp.save(os.path.join(root, "async2"), model, opt, async_save=True)
    out["second_waited_for_first"] = first.done()
    second.wait()
    fresh = _build(side, 1)
    hsdp.load(os.path.join(root, "async1"), fresh, _optimizer(fresh, "adamw"))
    out["async_holds_state_at_save"] = _same(hsdp.full_state_dict(fresh), at_save)

    # A save that fails midway (one rank's write raises) raises on every rank and leaves the
    # previous checkpoint at that path loadable.
    path = os.path.join(root, "async2")
    before = hsdp.full_state_dict(model)
    _steps(model, opt, range(K + 1, K + 2), rank, world)
    writer = hsdp.checkpoint.dcp.CheckpointWriter
    original = writer.write_data

    def failing(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("disk full (injected)")
        return original(self, plan, planner)

    writer.write_data = failing
    try:
        hsdp.save(path, model, opt)
        out["failed_save_raised"] = False
    except Exception as e:  # noqa: BLE001 - DCP wraps the rank's error
        out["failed_save_raised"] = "disk full" in str(e)
    finally:
        writer.write_data = original
    fresh = _build(side, 1)
    hsdp.load(path, fresh, _optimizer(fresh, "adamw"))
    out["previous_checkpoint_intact"] = _same(hsdp.full_state_dict(fresh), before)

    # Mismatches: an error naming the first mismatch, nothing changed.
    errors = {}
    other = _build(Side(2, 2), 2, GPTConfig(hidden=48, heads=4))
    other_opt = _optimizer(other, "adamw")
    snapshot = hsdp.full_state_dict(other)
    for what, target in (("shape", path), ("not_a_checkpoint", root + "/nothing-here")):
        try:
            hsdp.load(target, other, other_opt)
        except (ValueError, KeyError, FileNotFoundError) as e:
            errors[what] = str(e)
    deeper = _build(Side(2, 2), 2, GPTConfig(layers=4))
    deeper_opt = _optimizer(deeper, "adamw")
    try:
        hsdp.load(path, deeper, deeper_opt)
    except KeyError as e:
        errors["missing"] = str(e)
    out["errors"] = errors
    out["unchanged"] = (_same(hsdp.full_state_dict(other), snapshot) and not other_opt.state
                        and not deeper_opt.state)

    # model.state_dict() is sharded and usable with plain DCP (load reshards in place).
    import torch.distributed.checkpoint as dcp
    sd = model.state_dict()
    out["state_dict_shapes"] = all(tuple(sd[k].shape) == tuple(v.shape)
                                   for k, v in hsdp.full_state_dict(model).items())
    dcp.save(sd, checkpoint_id=os.path.join(root, "plain_dcp"))
    fresh = _build(Side(1, 4), 1)
    fresh_sd = fresh.state_dict()
    dcp.load(fresh_sd, checkpoint_id=os.path.join(root, "plain_dcp"))
    fresh.load_state_dict(fresh_sd)
    out["plain_dcp_roundtrip"] = _same(hsdp.full_state_dict(fresh),
                                       hsdp.full_state_dict(model))
    try:  # a DTensor from another layout is refused, not misread
        fresh.load_state_dict(model.state_dict())
        out["foreign_dtensor_refused"] = ""
    except ValueError as e:
        out["foreign_dtensor_refused"] = str(e)
    plain = _build(None, 3)
    fresh.load_state_dict(plain.state_dict())  # full tensors (every rank the same)
    out["full_tensors_load"] = _same(hsdp.full_state_dict(fresh),
                                     {k: v.detach() for k, v in plain.state_dict().items()})
    return out


def _plain(t: object) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


class Allocations(TorchDispatchMode):
    """Bytes of the new tensor storages ops create while active: the largest one and the
    peak of those still referenced."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if _plain(t)}
        for t in tree_flatten(out)[0]:  # a DTensor's own ops reach here on its local tensor
            if _plain(t) and t.untyped_storage().data_ptr() not in seen:
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                self.largest = max(self.largest, n)
                weakref.finalize(t, self._free, n)
        return out


@contextmanager
def gloo_releases_on_return() -> Iterator[None]:
    """gloo's worker thread lets go of a finished all-gather's tensors a moment after the
    synchronous call has returned (a quarter of 20,000 all-gathers on 2 ranks, measured),
    so their frees would reach ``Allocations`` late, as if the caller still held them:
    wait until it has let go (an error after 10 s rather than a hang)."""
    gather = hsdp.sharding.comm.torch_all_gather

    def settled(out: torch.Tensor, inp: torch.Tensor, **kwargs) -> None:
        held = out._use_count(), inp._use_count()
        gather(out, inp, **kwargs)
        deadline = time.monotonic() + 10
        while out._use_count() > held[0] or inp._use_count() > held[1]:
            if time.monotonic() > deadline:
                raise TimeoutError("gloo still holds an all-gather's tensors after 10 s")
            time.sleep(0)

    with mock.patch.object(hsdp.sharding.comm, "torch_all_gather", settled):
        yield


def memory_job(rank: int, world: int) -> dict[str, dict[str, int]]:
    return {s: _memory(rank, world, s) for s in ("hsdp", "hfsdp")}


def _memory(rank: int, world: int, strategy: str) -> dict[str, int]:
    """get_state_dict allocates nothing full-size; full_state_dict(rank0_only=True) holds at
    most one group's full parameters at a time on the ranks other than 0."""
    cfg = GPTConfig(vocab=64, hidden=64, heads=4, ffn=128, layers=4)
    model = _build(Side(2, 2, strategy), 0, cfg)
    opt = _optimizer(model, "adamw")
    tokens = _batches(0, 0, world, cfg)[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
    lm_loss(model(tokens), tokens).backward()
    opt.step()
    opt.zero_grad()
    with Allocations() as get:
        hsdp.get_state_dict(model, opt)
    with gloo_releases_on_return(), Allocations() as full:
        got = hsdp.full_state_dict(model, rank0_only=True)
    groups = {id(owner(p)[0]): owner(p)[0] for p in model.parameters()}.values()
    flat_bytes = [g.layout.total * 4 * (1.5 if g.shard_outer else 1) for g in groups]
    return {"get_largest": get.largest, "get_peak": get.peak, "full_peak": full.peak,
            "max_group_bytes": int(max(flat_bytes)), "all_groups_bytes": int(sum(flat_bytes)),
            "smallest_param_bytes": min(p.numel() * 4 for p in model.parameters()
                                        if p.dim() > 1), "keys": len(got)}


class Tied(nn.Module):
    """An embedding tied to the head inside one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def state_rows_job(rank: int, world: int) -> dict[str, object]:
    """Issue 9 rows 10 and 12: a per-rank optimizer.state_dict() from another mesh or
    strategy is refused on every rank before the step; tied weights inside one unit keep
    their alias keys and load from a plain model's state dict."""
    out: dict[str, object] = {}
    src = _build(Side(2, 2), 0)
    opt = _optimizer(src, "adamw")
    _steps(src, opt, range(1), rank, world)
    per_rank = opt.state_dict()
    for side in (Side(1, 4), Side(2, 2, "hfsdp")):
        dst = _build(side, 0)
        dst_opt = _optimizer(dst, "adamw")
        dst_opt.load_state_dict(per_rank)
        before = hsdp.full_state_dict(dst)
        try:
            _steps(dst, dst_opt, range(1, 2), rank, world)
            out[str(side)] = ""
        except RuntimeError as e:
            out[str(side)] = str(e)
        dst.zero_grad()
        out[f"{side}/unchanged"] = _same(hsdp.full_state_dict(dst), before)
    same = _build(Side(2, 2), 0)  # the same mesh and strategy: works
    same_opt = _optimizer(same, "adamw")
    same_opt.load_state_dict(opt.state_dict())
    _steps(same, same_opt, range(1, 2), rank, world)
    out["same_side_works"] = True

    mesh = _mesh(2, 2)
    torch.manual_seed(0)
    plain = Tied()
    tied = hsdp.fully_shard(Tied(), mesh=mesh)
    full = hsdp.full_state_dict(tied)
    out["alias_keys"] = sorted(full) == sorted(plain.state_dict())
    hsdp.load_full_state_dict(tied, plain.state_dict())
    want = {k: v.detach() for k, v in plain.state_dict().items()}
    out["plain_loads"] = _same(hsdp.full_state_dict(tied), want)
    torch.manual_seed(5)
    other = Tied()
    hsdp.load_full_state_dict(tied, other.state_dict() if rank == 0 else None, from_rank0=True)
    out["from_rank0"] = _same(hsdp.full_state_dict(tied),
                              {k: v.detach() for k, v in other.state_dict().items()})
    try:
        bad = dict(other.state_dict(), extra=torch.zeros(1))
        hsdp.load_full_state_dict(tied, bad if rank == 0 else None, from_rank0=True)
        out["from_rank0_error"] = ""
    except KeyError as e:
        out["from_rank0_error"] = str(e)
    return out


def hf_export_job(rank: int, world: int, root: str) -> dict[str, object]:
    """A transformers Llama (tied embedding and head) trained one step with hsdp, exported
    with full_state_dict(rank0_only=True) as safetensors, loads with from_pretrained and
    equals the single-process reference."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    mesh = _mesh(2, 2)
    for layer in model.model.layers:
        hsdp.fully_shard(layer, mesh=mesh)
    hsdp.fully_shard(model, mesh=mesh)
    tokens = torch.randint(0, 64, (world * ROWS_PER_RANK, 16),
                           generator=torch.Generator().manual_seed(0))
    mine = tokens[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
    for m, t in ((ref, tokens), (model, mine)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        m(input_ids=t, labels=t).loss.backward()
        opt.step()
    full = hsdp.full_state_dict(model, rank0_only=True)
    if rank != 0:
        return {"keys": len(full)}
    path = os.path.join(root, "hf")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, state_dict=full)
    loaded = transformers.LlamaForCausalLM.from_pretrained(path, use_kernels=False)  # offline
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    return {"keys": len(full), "err": _rel_err(dict(loaded.state_dict()), want),
            "safetensors": os.path.exists(os.path.join(path, "model.safetensors")),
            "tied": loaded.lm_head.weight is loaded.model.embed_tokens.weight}
