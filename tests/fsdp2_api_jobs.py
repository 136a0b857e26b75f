"""Multi-rank job for FSDP2 / torchtitan spellings of hsdp's API (tests/dist/test_fsdp2_api.py):
meshes, torch's MixedPrecisionPolicy, the FSDPModule methods and forward methods, each
trained against a single-process reference (and FSDP2 where it has the same call)."""

from __future__ import annotations

import copy
import json
import threading
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn as nn
from drop_in_jobs import (
    LR,
    MOMENTUM,
    ROWS_PER_RANK,
    STEPS,
    _pair,
    _reference,
    _shard,
    _traced_backward,
    rel_err,
    train,
)
from torch.distributed.device_mesh import init_device_mesh

import hsdp
from hsdp_tools.models import GPTConfig


def _error(call: Callable[[], object]) -> str:
    """The message ``call`` raised, its notes after it ("" when it did not raise)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test compares the message
        return "\n".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", ())])
    return ""


def case_meshes(rank: int, world: int, mesh) -> dict[str, float]:
    """torchtitan's dim names and a 1-D mesh train like hsdp's own mesh / the reference."""
    cfg = GPTConfig()
    ref = _reference(cfg, world)
    out = {}
    for name, shape, names in (("torchtitan", (2, world // 2), ("dp_replicate", "dp_shard")),
                               ("one_dim", (world,), ("dp",))):
        _, model = _pair(cfg)
        _shard(model, init_device_mesh("cpu", shape, mesh_dim_names=names))
        train(model, rank, world, cfg)
        out[name] = rel_err(hsdp.full_state_dict(model), ref)
        out[f"{name}_mesh"] = tuple(model._hsdp_unit.mesh.mesh.shape)
    return out


def case_mp_policy(rank: int, world: int, mesh) -> dict[str, object]:
    """torch's MixedPrecisionPolicy == hsdp.MixedPrecision with the same fields (bf16
    blocks, fp32 reduction and output); a bare dtype raises hsdp's TypeError."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cfg = GPTConfig()
    states = []
    for mp in (hsdp.MixedPrecision(torch.bfloat16, torch.float32, torch.float32),
               MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)):
        _, model = _pair(cfg)
        for blk in model.blocks:
            hsdp.fully_shard(blk, mesh=mesh, mp_policy=mp)
        hsdp.fully_shard(model, mesh=mesh)
        train(model, rank, world, cfg)
        states.append(hsdp.full_state_dict(model))
    _, model = _pair(cfg)
    return {"same": rel_err(states[1], states[0]),
            "ref": rel_err(states[1], _reference(cfg, world)),
            "dtype": _error(lambda: hsdp.fully_shard(model, mesh=mesh,
                                                     mp_policy=torch.bfloat16))}


def case_reshard(rank: int, world: int, mesh) -> dict[str, object]:
    """FSDP2's reshard_after_forward=None trains as True; an int and
    set_reshard_after_backward(False) raise hsdp errors naming what to use."""
    cfg = GPTConfig()
    _, model = _pair(cfg)
    _shard(model, mesh, reshard_after_forward=None)
    errors = {"int": _error(lambda: hsdp.fully_shard(_pair(cfg)[1], mesh=mesh,
                                                     reshard_after_forward=2)),
              "set_int": _error(lambda: model.blocks[0].set_reshard_after_forward(2)),
              "after_backward": _error(lambda: model.set_reshard_after_backward(False)),
              "after_backward_true": _error(lambda: model.set_reshard_after_backward(True))}
    train(model, rank, world, cfg)
    return {"ref": rel_err(hsdp.full_state_dict(model), _reference(cfg, world)), **errors}


def case_deferred_outer(rank: int, world: int, mesh, method: str) -> dict[str, object]:
    """Microbatches 0..2 with ``method(False)``, the last with True (FSDP2's
    set_requires_all_reduce / set_is_last_backward pattern): no outer reduction before the
    last, and the result of the reference and of FSDP2 making the same calls."""
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    cfg = GPTConfig()
    n = 4
    _, model = _pair(cfg)
    fsdp2 = copy.deepcopy(model)
    _shard(model, mesh)
    early: list[str] = []

    def micro(m: nn.Module, step: int, i: int, n: int) -> AbstractContextManager:
        getattr(m, method)(i == n - 1)
        return _traced_backward(m._hsdp_unit.tracer, early) if i < n - 1 else nullcontext()

    train(model, rank, world, cfg, microbatches=n, micro=micro)
    for blk in fsdp2.blocks:
        fsdp2_shard(blk, mesh=mesh)
    fsdp2_shard(fsdp2, mesh=mesh)

    def fsdp2_micro(m: nn.Module, step: int, i: int, n: int) -> AbstractContextManager:
        getattr(m, method)(i == n - 1)
        return nullcontext()

    train(fsdp2, rank, world, cfg, microbatches=n, micro=fsdp2_micro)
    f2 = {k: v.full_tensor().detach() for k, v in fsdp2.state_dict().items()}
    mine = hsdp.full_state_dict(model)
    return {"ref": rel_err(mine, _reference(cfg, world, n)), "fsdp2": rel_err(mine, f2),
            "outer_before_last": sum(op.startswith("OUTER") for op in early),
            "inner_before_last": sum(op.startswith("RS") for op in early),
            "not_root": _error(lambda: getattr(model.blocks[0], method)(False))}


class _Encoder(nn.Module):
    """A model with second entry points that use the root unit's parameters directly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(x))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.lin.weight.t() + self.lin.bias)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def case_forward_method(rank: int, world: int, mesh, strategy: str) -> dict[str, object]:
    """Training through ``encode`` (not forward), registered with torch's
    ``torch.distributed.fsdp.register_fsdp_forward_method`` as FSDP2 users do: it trains
    like the reference and like FSDP2 registered the same way. torch's function as it was
    before hsdp sharded a module (a reference imported early) does nothing on hsdp modules:
    the errors of the unregistered methods name ``hsdp.register_forward_method``."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    torch.manual_seed(0)
    ref = _Encoder()
    model, fsdp2 = copy.deepcopy(ref), copy.deepcopy(ref)
    hsdp.fully_shard(model.head, mesh=mesh, strategy=strategy)
    hsdp.fully_shard(model, mesh=mesh, strategy=strategy)
    early = torch_fsdp.register_fsdp_forward_method.__wrapped__  # torch's own
    early(model, "encode")
    early(model, "project")
    x0 = torch.randn(world * ROWS_PER_RANK, 6)
    unregistered = _error(lambda: model.encode(x0))
    project = _error(lambda: model.project(x0))
    outside = _error(lambda: model.head(torch.randn(2, 5)))  # a unit's forward on its own
    torch_fsdp.register_fsdp_forward_method(model, "encode")
    fsdp2_shard(fsdp2.head, mesh=mesh)
    fsdp2_shard(fsdp2, mesh=mesh)
    torch_fsdp.register_fsdp_forward_method(fsdp2, "encode")
    models = (ref, model, fsdp2)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    for step in range(STEPS):
        x = torch.randn(world * ROWS_PER_RANK, 6, generator=torch.Generator().manual_seed(step))
        ref.encode(x).square().mean().backward()
        for m in models[1:]:
            m.encode(x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]).square().mean() \
                .backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    y = model(x0)  # forward still works after
    mine = hsdp.full_state_dict(model)
    return {"unregistered": unregistered, "project": project, "outside": outside,
            "ref": rel_err(mine, {k: v.detach() for k, v in ref.state_dict().items()}),
            "fsdp2": rel_err(mine, {k: v.full_tensor().detach()
                                    for k, v in fsdp2.state_dict().items()}),
            "sharded_after": all(type(p).__name__ == "Piece" for p in model.parameters()),
            "forward": rel_err({"y": y.detach()}, {"y": ref(x0).detach()}),
            "missing": _error(lambda: hsdp.register_forward_method(model, "decode"))}


def case_all_reduce_hook(rank: int, world: int, mesh) -> dict[str, object]:
    """FSDP2's ``set_all_reduce_hook`` (torchtitan's fault-tolerant HSDP sets it on every
    FSDP module): the same hook (it halves the reduced gradient) on hsdp and FSDP2, on the
    2x2 mesh (after the outer all-reduce) and a 1-D one (after the reduce-scatter), trains
    to the same parameters; hsdp calls it on its outer stream (a worker thread on CPU), once
    per unit and step. A stream, and strategy hfsdp, raise."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from hsdp.module import HSDPModule

    cfg = GPTConfig()
    out: dict[str, object] = {}
    for name, dp_mesh in (("2x2", mesh), ("one_dim", init_device_mesh("cpu", (world,)))):
        threads: dict[str, list[str]] = {"hsdp": [], "fsdp2": []}
        _, model = _pair(cfg)
        fsdp2 = copy.deepcopy(model)
        _shard(model, dp_mesh)
        for blk in fsdp2.blocks:
            fsdp2_shard(blk, mesh=dp_mesh)
        fsdp2_shard(fsdp2, mesh=dp_mesh)
        for kind, m, cls in (("hsdp", model, HSDPModule), ("fsdp2", fsdp2, FSDPModule)):
            def halve(t: torch.Tensor, seen: list[str] = threads[kind]) -> None:
                seen.append(threading.current_thread().name)
                t.mul_(0.5)
            for sub in m.modules():
                if isinstance(sub, cls):
                    sub.set_all_reduce_hook(halve)
            if kind == "hsdp":
                train(m, rank, world, cfg)
            else:
                train(m, rank, world, cfg, micro=lambda *_: nullcontext())
        f2 = {k: v.full_tensor().detach() for k, v in fsdp2.state_dict().items()}
        mine = hsdp.full_state_dict(model)
        out[f"{name}/fsdp2"] = rel_err(mine, f2)
        out[f"{name}/ref"] = rel_err(mine, _reference(cfg, world))  # the hook changed it
        out[f"{name}/calls"] = (len(threads["hsdp"]), len(threads["fsdp2"]))
        out[f"{name}/threads"] = sorted(set(threads["hsdp"]))
    _, model = _pair(cfg)
    _shard(model, mesh, strategy="hfsdp")
    out["hfsdp"] = _error(lambda: model.set_all_reduce_hook(print))
    out["stream"] = _error(lambda: model.set_all_reduce_hook(print, stream=object()))
    return out


def case_refusals(rank: int, world: int, mesh) -> dict[str, str]:
    """FSDP2 habits that hsdp refuses, each with an error naming what to do: CPU offload
    (its default ``OffloadPolicy()`` is accepted), and transformers' ``save_pretrained``
    of the sharded model without a ``state_dict``; with ``hsdp.full_state_dict``'s it
    writes the weights, and config.json names the model's own class, as for the unsharded
    model ("" where transformers is not installed)."""
    import importlib.util
    import os
    import tempfile

    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    cfg = GPTConfig()
    out = {"cpu_offload": _error(lambda: hsdp.fully_shard(
               _pair(cfg)[1], mesh=mesh, offload_policy=CPUOffloadPolicy())),
           "no_offload": _error(lambda: hsdp.fully_shard(
               _pair(cfg)[1], mesh=mesh, offload_policy=OffloadPolicy())),
           "save_pretrained": "", "saved": "", "architectures": None,
           "class_after": ""}
    if importlib.util.find_spec("transformers") is None:
        return out
    import transformers

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    for layer in llama.model.layers:
        hsdp.fully_shard(layer, mesh=mesh)
    hsdp.fully_shard(llama, mesh=mesh)
    with tempfile.TemporaryDirectory() as d:
        out["save_pretrained"] = _error(lambda: llama.save_pretrained(d))
        full = hsdp.full_state_dict(llama, rank0_only=True)
        if rank == 0:
            llama.save_pretrained(d, state_dict=full)
        out["saved"] = str(os.path.exists(os.path.join(d, "model.safetensors")) or rank > 0)
        if rank == 0:
            with open(os.path.join(d, "config.json")) as f:
                out["architectures"] = json.load(f)["architectures"]
    out["class_after"] = type(llama).__name__
    return out


def fsdp2_api_job(rank: int, world: int, cases: list[tuple]) -> dict[tuple, dict]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = hsdp.init_mesh(2, world // 2, "cpu")
    return {case: globals()[f"case_{case[0]}"](rank, world, mesh, *case[1:])
            for case in cases}
