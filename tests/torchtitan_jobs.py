"""Multi-rank job for tests/dist/test_torchtitan.py: torchtitan's Llama3 ``debugmodel`` (SDPA
attention, fp32) on a 2x2 gloo mesh through ``hsdp.integrations.torchtitan``, as
torchtitan's trainer drives it (meta build, ``parallelize_fn``, ``to_empty``,
``init_weights``; loss summed over tokens and divided by the global token count; its
``clip_grad_norm_``), against one process and torchtitan's own FSDP2 ``parallelize_llama``
on the same mesh. SGD with momentum (Adam turns reduction-order noise into full-size
updates)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import distribute_tensor
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as titan_dims_module
from torchtitan.distributed import utils as titan_dist
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3 import parallelize_llama as fsdp2_parallelize_llama
from torchtitan.protocols.module import Module as TitanModule

import hsdp
from hsdp.integrations import torchtitan as hsdp_titan

ROWS, SEQ, STEPS, MAX_NORM = 2, 16, 10, 1.0


def _model_config():
    cfg = model_registry("debugmodel").model
    for layer in cfg.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return _model_config().build()


def _reference() -> nn.Module:
    """One process, initialized as hsdp's ``init_weights`` does: each module's own
    initializers in ``modules()`` order under seed 0."""
    model = _meta_model()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, TitanModule):
                m._init_self_parameters()
                m._init_self_buffers(buffer_device=None)
    return model


def _batches(world: int, microbatches: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 2048, (STEPS, microbatches, world, ROWS, SEQ + 1), generator=g)


def _loss(model: nn.Module, seqs: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """torchtitan's scaling: token losses summed, divided by the global token count."""
    tokens, labels = seqs[..., :-1], seqs[..., 1:]
    pos = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    logits = model(tokens, positions=pos)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                           reduction="sum") / global_tokens


def _train(model: nn.Module, rows: slice | int, world: int, microbatches: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _batches(world, microbatches)
    global_tokens = world * ROWS * SEQ * microbatches
    for step in range(STEPS):
        for mb in range(microbatches):
            seqs = data[step, mb, rows].reshape(-1, SEQ + 1)
            _loss(model, seqs, global_tokens).backward()
        titan_dist.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)
        opt.step()
        opt.zero_grad()


@torch.no_grad()
def _full_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for p in model.parameters()]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


def _parallelize(fn, model: nn.Module, dims: ParallelDims, ac: bool, reshard: str,
                 **kw) -> nn.Module:
    return fn(model, parallel_dims=dims,
              training=TrainingConfig(mixed_precision_param="float32",
                                      mixed_precision_reduce="float32"),
              parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                            fsdp_reshard_after_forward=reshard),
              compile_config=CompileConfig(), ac_config=SelectiveAC.Config() if ac else None,
              dump_folder="", **kw)


def parity_job(rank: int, world: int) -> dict[str, float]:
    """Relative parameter error after ``STEPS`` steps of each configuration, against one
    process (``ref``) and against torchtitan's FSDP2 path (``fsdp2``)."""
    # torchtitan takes "cuda" for its meshes wherever no accelerator is found
    titan_dims_module.device_type = "cpu"
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    init = list(_reference().parameters())
    out: dict[str, float] = {}
    for microbatches in (1, 2):
        ref = _reference()
        _train(ref, slice(None), world, microbatches)
        want = _full_params(ref)

        fsdp2 = _parallelize(fsdp2_parallelize_llama, _meta_model(), dims, False, "default")
        for m in fsdp2.modules():  # gloo has no PREMUL_SUM
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        fsdp2.to_empty(device="cpu")
        with torch.no_grad():  # buffers by torchtitan's init, parameters the reference's
            fsdp2.init_weights(buffer_device=None)
            for p, q in zip(fsdp2.parameters(), init):
                p.copy_(distribute_tensor(q.detach(), p.device_mesh, p.placements))
        _train(fsdp2, rank, world, microbatches)
        fsdp2_params = _full_params(fsdp2)
        out[f"fsdp2 mb={microbatches} vs ref"] = _rel(fsdp2_params, want)

        for strategy, overlap, ac, reshard in (("hsdp", True, True, "default"),
                                               ("hfsdp", False, False, "always")):
            model = _parallelize(hsdp_titan.parallelize_llama, _meta_model(), dims, ac,
                                 reshard, strategy=strategy, overlap_outer=overlap)
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            with torch.no_grad():
                model.init_weights(buffer_device=None)
            name = f"{strategy} mb={microbatches} ac={ac} reshard={reshard}"
            out[f"{name} init vs ref"] = _rel(_full_params(model), _full_params(_reference()))
            _train(model, rank, world, microbatches)
            got = _full_params(model)
            out[f"{name} vs ref"] = _rel(got, want)
            out[f"{name} vs fsdp2"] = _rel(got, fsdp2_params)
            hsdp.synchronize(model)
    return out
