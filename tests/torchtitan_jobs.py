"""Multi-rank job for tests/dist/test_torchtitan.py: torchtitan's Llama3 ``debugmodel`` (SDPA
attention, fp32) on a 2x2 gloo mesh through ``hsdp.integrations.torchtitan``, as
torchtitan's trainer drives it (meta build, ``parallelize_fn``, ``to_empty``,
``init_weights``; loss summed over tokens and divided by the global token count; its
``clip_grad_norm_``), against one process and torchtitan's own FSDP2 ``parallelize_llama``
on the same mesh. SGD with momentum (Adam turns reduction-order noise into full-size
updates)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from titan_cpu_configs import fsdp2_on_gloo
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
    register_moe_load_balancing_hook,
)
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as titan_dims_module
from torchtitan.distributed import utils as titan_dist
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models import deepseek_v3, llama3
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
from torchtitan.protocols.module import Module as TitanModule

import hsdp
from hsdp.integrations import torchtitan as hsdp_titan

ROWS, SEQ, STEPS, MAX_NORM = 2, 16, 10, 1.0
FLOAT8_STEPS = 5
TP_STEPS = 3  # as the 8-rank TP tests of tests/dist/test_tp.py


@dataclass(frozen=True)
class Arch:
    """A torchtitan model family's ``debugmodel`` as these jobs build it: its registry, its
    FSDP2 ``parallelize_fn``, the parallelism its sharding specs are set for, and how many
    of its layers are kept (None: all)."""

    registry: Callable
    fsdp2: Callable
    parallelism: dict = field(default_factory=dict)
    layers: int | None = None


LLAMA = Arch(llama3.model_registry, fsdp2_on_gloo)
# DeepSeek-V3's debugmodel, 1 dense block and 2 MoE blocks (8 experts, top 3), experts
# split over expert_parallel_degree 2
MOE = Arch(deepseek_v3.model_registry,
           functools.partial(fsdp2_on_gloo, parallelize_fn=parallelize_deepseekv3),
           {"expert_parallel_degree": 2, "spmd_backend": "partial_dtensor"}, layers=3)


def _model_config(converters: list | None = None, arch: Arch = LLAMA):
    """``debugmodel`` with SDPA attention and, as torchtitan's trainer sets them
    (``update_from_config``), its tensor-parallel (and expert-parallel) sharding specs:
    ``parallelize`` applies them on a tp (ep) mesh and ignores them without one."""
    cfg = arch.registry("debugmodel", converters=converters).model
    if arch.layers is not None:
        cfg.layers = cfg.layers[:arch.layers]
    for layer in cfg.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.update_from_config(config=SimpleNamespace(
        parallelism=ParallelismConfig(**arch.parallelism)))
    return cfg


def _meta_model(converters: list | None = None, arch: Arch = LLAMA) -> nn.Module:
    with torch.device("meta"):
        return _model_config(converters, arch).build()


def _reference(converters: list | None = None, arch: Arch = LLAMA) -> nn.Module:
    """One process, initialized as hsdp's ``init_weights`` does: each module's own
    initializers in ``modules()`` order under seed 0."""
    model = _meta_model(converters, arch)
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
    if isinstance(logits, DTensor):  # torchtitan's TP output: sharded over the vocabulary
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                           reduction="sum") / global_tokens


def _train(model: nn.Module, rows: slice | int | range, world: int, microbatches: int,
           after_step: Callable[[nn.Module], None] | None = None, steps: int = STEPS,
           max_norm: float = MAX_NORM, dims: ParallelDims | None = None) -> None:
    """``steps`` SGD steps on ``rows`` of each batch (a range: each row group in a forward
    of its own, as the ranks run them), gradients clipped to ``max_norm``; with ``dims``,
    torchtitan's MoE load balancing (expert biases updated from the token counts before
    each step, outside the optimizer)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if dims is not None:
        register_moe_load_balancing_hook(opt, [model], dims)
    data = _batches(world, microbatches)
    global_tokens = world * ROWS * SEQ * microbatches
    for step in range(steps):
        for mb in range(microbatches):
            for r in rows if isinstance(rows, range) else [rows]:
                seqs = data[step, mb, r].reshape(-1, SEQ + 1)
                _loss(model, seqs, global_tokens).backward()
        _clip([model], max_norm)
        opt.step()
        if after_step is not None:
            after_step(model)
        opt.zero_grad()


def _clip(parts: list[nn.Module], max_norm: float,
          pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_``, told of pipeline and expert parallelism as its
    trainer does."""
    params = [p for m in parts for p in m.parameters()]
    ep = any(isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
             for p in params)
    return titan_dist.clip_grad_norm_(params, max_norm, foreach=True, pp_mesh=pp_mesh,
                                      ep_enabled=ep)


@torch.no_grad()
def _full_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for p in model.parameters()]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


def _fsdp2_on(model: nn.Module, dims: ParallelDims, init: list[torch.Tensor],
              ac: bool = False, arch: Arch = LLAMA) -> nn.Module:
    """torchtitan's FSDP2 path on the meta-built ``model``, its parameters ``init``."""
    model = _parallelize(arch.fsdp2, model, dims, ac, "default")
    model.to_empty(device="cpu")
    with torch.no_grad():  # buffers by torchtitan's init, parameters the reference's
        model.init_weights(buffer_device=None)
        for p, q in zip(model.parameters(), init):
            p.copy_(distribute_tensor(q.detach(), p.device_mesh, p.placements))
    return model


def titan_args(ac: bool, reshard: str, training: dict | None = None,
               **parallelism) -> dict:
    """The configs torchtitan's trainer passes a ``parallelize_fn`` (fp32; ``training`` and
    ``parallelism``: further fields of its training and parallelism configs)."""
    return dict(training=TrainingConfig(mixed_precision_param="float32",
                                        mixed_precision_reduce="float32", **(training or {})),
                parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                              fsdp_reshard_after_forward=reshard,
                                              **parallelism),
                compile_config=CompileConfig(), ac_config=SelectiveAC.Config() if ac else None,
                dump_folder="")


def _parallelize(fn, model: nn.Module, dims: ParallelDims, ac: bool, reshard: str,
                 **kw) -> nn.Module:
    return fn(model, parallel_dims=dims, **titan_args(ac, reshard), **kw)


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

        fsdp2 = _fsdp2_on(_meta_model(), dims, init)
        _train(fsdp2, rank, world, microbatches)
        fsdp2_params = _full_params(fsdp2)
        out[f"fsdp2 mb={microbatches} vs ref"] = _rel(fsdp2_params, want)

        configs = [("hsdp", True, True, "default", None), ("hfsdp", False, False, "always", None)]
        if microbatches == 2:  # the compressed outer reduction (block 16), through torchtitan
            configs.append(("hsdp", True, False, "default", "int8:16"))
        for strategy, overlap, ac, reshard, outer_reduce in configs:
            model = _parallelize(hsdp_titan.parallelize_llama, _meta_model(), dims, ac,
                                 reshard, strategy=strategy, overlap_outer=overlap,
                                 outer_reduce=outer_reduce)
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            with torch.no_grad():
                model.init_weights(buffer_device=None)
            name = (f"{strategy}{'+' + outer_reduce if outer_reduce else ''} "
                    f"mb={microbatches} ac={ac} reshard={reshard}")
            out[f"{name} init vs ref"] = _rel(_full_params(model), _full_params(_reference()))
            _train(model, rank, world, microbatches)
            got = _full_params(model)
            out[f"{name} vs ref"] = _rel(got, want)
            out[f"{name} vs fsdp2"] = _rel(got, fsdp2_params)
            hsdp.synchronize(model)
    return {**out, **_diloco_entries(rank, world, dims)}


DILOCO_H1 = "diloco:inner_steps=1,outer_lr=1,momentum=0"


def _diloco_entries(rank: int, world: int, dims: ParallelDims) -> dict[str, float | str]:
    """DiLoCo through ``parallelize_llama``'s ``outer_sync`` (the trainer's
    ``--hsdp.outer_sync``): at H=1, outer_lr=1, momentum=0 each replica's
    SGD-momentum update (momentum is linear in the gradients) averages to the synchronous
    one, if each replica's gradient is its own mean on torchtitan's scale (the loss is
    divided by every DP rank's tokens): against one process, unclipped (clipping is per
    replica under DiLoCo). Also the schedule the model runs."""
    ref = _reference()
    _train(ref, slice(None), world, 1, max_norm=float("inf"))
    model = _parallelize(hsdp_titan.parallelize_llama, _meta_model(), dims, False,
                         "default", outer_sync=DILOCO_H1)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    _train(model, rank, world, 1, max_norm=float("inf"))
    hsdp.synchronize(model)
    return {"hsdp+diloco H=1 vs unclipped ref": _rel(_full_params(model), _full_params(ref)),
            "hsdp+diloco schedule": repr(model._hsdp_unit.runtime.outer.config)}


def _float8_train(model: nn.Module, rows: int | range, world: int,
                  after_step: Callable[[nn.Module], None] | None = None
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``FLOAT8_STEPS`` steps; the full parameters after the first step and the last."""
    first: list[list[torch.Tensor]] = []

    def record(m: nn.Module) -> None:
        if after_step is not None:
            after_step(m)
        if not first:
            first.append([t.clone() for t in _full_params(m)])

    _train(model, rows, world, 1, after_step=record, steps=FLOAT8_STEPS)
    return first[0], _full_params(model)


def float8_parity_job(rank: int, world: int) -> dict[str, float | int]:
    """torchtitan's ``debugmodel`` through a float8 converter (tensorwise, emulated) on the
    2x2 mesh: hsdp with float8 all-gather (hsdp's converter; torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` called after each step as FSDP2 users
    do) and without it (torchtitan's own converter), against one process with the same
    conversion and torchtitan's FSDP2 path, after the first step and after the last
    (float8 casts turn reduction-order noise into whole float8 steps from the second
    step on: only runs with the same reduction order stay within 1e-5 there). Also the
    number of weights hsdp gathers in float8 per configuration."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchtitan.components.quantization import Float8LinearConverter as TitanFloat8

    from hsdp.integrations.torchtitan_float8 import Float8LinearConverter

    titan_dims_module.device_type = "cpu"
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    f8_gather = [Float8LinearConverter.Config(emulate=True)]
    ref = _reference(f8_gather)
    init = [p.detach().clone() for p in ref.parameters()]
    # each rank's rows apart: float8 activation and gradient scales are per forward
    want = _float8_train(ref, range(world), world)
    fsdp2 = _float8_train(_fsdp2_on(_meta_model(f8_gather), dims, init), rank, world)
    out: dict[str, float | int] = {"fsdp2 step 1 vs ref": _rel(fsdp2[0], want[0]),
                                   "fsdp2 last vs ref": _rel(fsdp2[1], want[1])}
    for name, converters, strategy, overlap in (
            ("hsdp float8 all-gather", f8_gather, "hsdp", True),
            ("hfsdp float8 all-gather", f8_gather, "hfsdp", False),
            ("hsdp torchtitan converter", [TitanFloat8.Config(emulate=True)], "hsdp", True)):
        model = _parallelize(hsdp_titan.parallelize_llama, _meta_model(converters), dims,
                             True, "default", strategy=strategy, overlap_outer=overlap)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        got = _float8_train(model, rank, world, precompute_float8_dynamic_scale_for_fsdp)
        out[f"{name} float8 weights"] = sum(
            len(g.float8.scales) for g in model._hsdp_unit.runtime.float8_groups)
        for i, when in enumerate(("step 1", "last")):
            out[f"{name} {when} vs ref"] = _rel(got[i], want[i])
            out[f"{name} {when} vs fsdp2"] = _rel(got[i], fsdp2[i])
        hsdp.synchronize(model)
    return out


class _TrainState(Stateful):
    """The step counter, saved as torchtitan's trainer saves its ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.step = state_dict["step"]


# AdamW through torchtitan's OptimizersContainer (it offers no SGD). eps=0.1 keeps the
# update proportional to the gradient (lr * m / (sqrt(v) + eps)), so reduction-order
# noise between FSDP2 and hsdp stays noise (testing.md: Adam at eps=1e-8 amplifies it).
_OPTIMIZER = OptimizersContainer.Config(
    implementation="foreach",
    param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                   optimizer_kwargs={"lr": 0.05, "betas": (0.9, 0.95),
                                                     "eps": 0.1, "weight_decay": 0.1})])
_LR = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                   min_lr_factor=0.0)
SAVE_AT = 5


def _titan_run(model: nn.Module, rank: int, world: int, folder: str, resume: bool,
               async_mode: str = "disabled", dims: ParallelDims | None = None
               ) -> tuple[nn.Module, list[float]]:
    """``titan_loop`` on ``model``, this rank's rows of each step's batch (one
    microbatch). Returns the model and this rank's loss per step run. With ``dims``,
    torchtitan's MoE load balancing."""
    data = _batches(world, 1)

    def step_fn(step: int) -> float:
        loss = _loss(model, data[step - 1, 0, rank], world * ROWS * SEQ)
        loss.backward()
        return loss.item()

    return model, titan_loop([model], step_fn, folder, resume, async_mode, dims=dims)


def titan_loop(parts: list[nn.Module], step_fn: Callable[[int], float], folder: str | None,
               resume: bool, async_mode: str = "disabled", pp_mesh: DeviceMesh | None = None,
               norms: list[float] | None = None, max_norm: float = MAX_NORM,
               dims: ParallelDims | None = None) -> list[float]:
    """torchtitan's training loop pieces on the model ``parts``: its optimizer container,
    LR schedulers, ``clip_grad_norm_`` (over the pipeline ranks of ``pp_mesh``) and, with
    a ``folder``, ``CheckpointManager`` (DCP) saving at step ``SAVE_AT`` into it
    (``async_mode``: its ``--checkpoint.async_mode``), or, with ``resume``, loading from
    there and running the steps after it. ``step_fn(step)`` runs one step's forwards and
    backwards and returns this rank's loss; the losses are returned, the gradient norms
    appended to ``norms``. With ``dims``, torchtitan's MoE load balancing."""
    opt = _OPTIMIZER.build(model_parts=parts)
    if dims is not None:
        register_moe_load_balancing_hook(opt, parts, dims)
    lr = _LR.build(optimizers=opt, training_steps=STEPS)
    state = _TrainState()
    ckpt = None if folder is None else CheckpointManager.Config(
        enable=True, interval=SAVE_AT, last_save_model_only=False, keep_latest_k=0,
        exclude_from_loading=["dataloader"], async_mode=async_mode,
    ).build(dataloader=None, model_parts=parts, optimizers=opt, lr_schedulers=lr,
            states={"train_state": state}, sd_adapter=None, base_folder=folder)
    if resume:
        assert ckpt.load(step=SAVE_AT) and state.step == SAVE_AT
    losses = []
    for step in range(state.step + 1, STEPS + 1):
        losses.append(step_fn(step))
        norm = _clip(parts, max_norm, pp_mesh)
        if norms is not None:
            norms.append(norm.item())
        opt.step()
        lr.step()
        opt.zero_grad()
        state.step = step
        if ckpt is not None and not resume:
            ckpt.save(curr_step=step)
    if ckpt is not None:
        ckpt.maybe_wait_for_saving()
        ckpt.close()
    return losses


def _hsdp_model(dims: ParallelDims, strategy: str, ac: bool = True,
                arch: Arch = LLAMA, **kw: object) -> nn.Module:
    model = _parallelize(hsdp_titan.parallelize_llama, _meta_model(arch=arch), dims, ac,
                         "default",
                         strategy=strategy, overlap_outer=strategy == "hsdp", **kw)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _fsdp2_model(dims: ParallelDims, arch: Arch = LLAMA) -> nn.Module:
    """torchtitan's FSDP2 path, with the parameters hsdp's ``init_weights`` gives."""
    return _fsdp2_on(_meta_model(arch=arch), dims,
                     list(_reference(arch=arch).parameters()), ac=True, arch=arch)


def checkpoint_job(rank: int, world: int, root: str) -> dict[str, float | bool]:
    """torchtitan's ``CheckpointManager`` on hsdp models: a resume from step ``SAVE_AT``
    equals the uninterrupted run bit for bit (both strategies, and a save in torchtitan's
    ``async`` mode, written while training goes on; its ``async_with_pinned_mem`` needs
    CUDA), and checkpoints cross between torchtitan's FSDP2 path and hsdp (each resumed
    run against the uninterrupted run of the path that wrote the checkpoint, relative
    error)."""
    titan_dims_module.device_type = "cpu"
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    out: dict[str, float | bool] = {}
    full: dict[str, list[torch.Tensor]] = {}
    for strategy in ("hsdp", "hfsdp"):
        model, losses = _titan_run(_hsdp_model(dims, strategy), rank, world,
                                   f"{root}/{strategy}", resume=False)
        full[strategy] = _full_params(model)
        hsdp.synchronize(model)
        model, resumed = _titan_run(_hsdp_model(dims, strategy), rank, world,
                                    f"{root}/{strategy}", resume=True)
        got = _full_params(model)
        out[f"{strategy} resume equal"] = (resumed == losses[SAVE_AT:] and all(
            torch.equal(a, b) for a, b in zip(got, full[strategy])))
        hsdp.synchronize(model)
    model, async_losses = _titan_run(_hsdp_model(dims, "hsdp"), rank, world,
                                     f"{root}/hsdp-async", resume=False, async_mode="async")
    hsdp.synchronize(model)
    model, resumed = _titan_run(_hsdp_model(dims, "hsdp"), rank, world, f"{root}/hsdp-async",
                                resume=True)
    out["hsdp async resume equal"] = (resumed == async_losses[SAVE_AT:] and all(
        torch.equal(a, b) for a, b in zip(_full_params(model), full["hsdp"])))
    hsdp.synchronize(model)
    model, _ = _titan_run(_fsdp2_model(dims), rank, world, f"{root}/fsdp2", resume=False)
    full["fsdp2"] = _full_params(model)
    out["fsdp2 vs hsdp uninterrupted"] = _rel(full["fsdp2"], full["hsdp"])
    model, _ = _titan_run(_hsdp_model(dims, "hsdp"), rank, world, f"{root}/fsdp2",
                          resume=True)
    out["fsdp2 ckpt -> hsdp"] = _rel(_full_params(model), full["fsdp2"])
    hsdp.synchronize(model)
    model, _ = _titan_run(_fsdp2_model(dims), rank, world, f"{root}/hsdp", resume=True)
    out["hsdp ckpt -> fsdp2"] = _rel(_full_params(model), full["hsdp"])
    return out


def extra_state_job(rank: int, world: int, root: str) -> dict[str, bool]:
    """torchtitan's ``CheckpointManager`` on hsdp models with an int8 outer reduction
    (error feedback) and with DiLoCo saved mid-period (step ``SAVE_AT``, period 3): does
    the resumed run equal the uninterrupted one bit for bit (losses and parameters), and
    does the checkpoint hold hsdp's residual / DiLoCo keys?"""
    titan_dims_module.device_type = "cpu"
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    out: dict[str, bool] = {}
    cases = {"int8": ({"outer_reduce": "int8"}, "hsdp_outer_residual"),
             "diloco": ({"outer_sync": "diloco:inner_steps=3,outer_lr=0.7,momentum=0.9"},
                        "hsdp_outer_sync")}
    for name, (kw, key) in cases.items():
        folder = f"{root}/{name}"
        model, losses = _titan_run(_hsdp_model(dims, "hsdp", **kw), rank, world, folder,
                                   resume=False)
        full = _full_params(model)
        hsdp.synchronize(model)
        model, resumed = _titan_run(_hsdp_model(dims, "hsdp", **kw), rank, world, folder,
                                    resume=True)
        out[f"{name} resume equal"] = resumed == losses[SAVE_AT:] and all(
            torch.equal(a, b) for a, b in zip(_full_params(model), full))
        saved = dcp.FileSystemReader(f"{folder}/checkpoint/step-{SAVE_AT}").read_metadata()
        out[f"{name} keys saved"] = any(k.startswith(f"optimizer.{key}.")
                                        for k in saved.state_dict_metadata)
        hsdp.synchronize(model)
    return out


def _tp_sharded(model: nn.Module) -> int:
    """How many parameters are sharded over the mesh dimension named "tp"."""
    return sum(1 for p in model.parameters() if isinstance(p, DTensor)
               and "tp" in (names := p.device_mesh.mesh_dim_names or ())
               and p.placements[names.index("tp")].is_shard())


def tp_parity_job(rank: int, world: int) -> dict[str, float | int]:
    """``tensor_parallel_degree`` 2 on (dp_replicate, dp_shard, tp) = (2, 2, 2): torchtitan's
    own TP plan (sequence parallel, the sharding specs ``_model_config`` sets), then hsdp
    (both strategies, with and without its selective AC) or torchtitan's FSDP2; relative
    parameter error after ``TP_STEPS`` steps against one process and against the FSDP2 + TP
    path, and how many parameters each model shards over tp. The tp ranks of one DP rank
    see the same rows."""
    titan_dims_module.device_type = "cpu"
    tp = 2
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=tp, pp=1, ep=1,
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    dp, dp_rank = world // tp, rank // tp
    ref = _reference()
    _train(ref, slice(None), dp, 1, steps=TP_STEPS)
    want = _full_params(ref)
    fsdp2 = _fsdp2_model(dims)
    out: dict[str, float | int] = {"fsdp2+tp tp-sharded": _tp_sharded(fsdp2)}
    _train(fsdp2, dp_rank, dp, 1, steps=TP_STEPS)
    fsdp2_params = _full_params(fsdp2)
    out["fsdp2+tp vs ref"] = _rel(fsdp2_params, want)
    for strategy, ac in (("hsdp", True), ("hfsdp", False)):
        model = _hsdp_model(dims, strategy, ac)
        out[f"{strategy} ac={ac} tp-sharded"] = _tp_sharded(model)
        out[f"{strategy} ac={ac} init vs ref"] = _rel(_full_params(model),
                                                      _full_params(_reference()))
        _train(model, dp_rank, dp, 1, steps=TP_STEPS)
        got = _full_params(model)
        out[f"{strategy} ac={ac} vs ref"] = _rel(got, want)
        out[f"{strategy} ac={ac} vs fsdp2+tp"] = _rel(got, fsdp2_params)
        hsdp.synchronize(model)
    return out


def moe_job(rank: int, world: int, root: str) -> dict[str, float | bool | int]:
    """``expert_parallel_degree`` 2 on (dp_replicate, dp_shard) = (2, world / 2): DeepSeek-V3's
    debugmodel (``MOE``) with torchtitan's expert parallelism and load balancing; hsdp
    (expert units on the (2, world / 4, 2) expert mesh, nested in the blocks') against one
    process and torchtitan's FSDP2 path after ``STEPS`` steps (relative error), and a
    resume from step ``SAVE_AT`` through torchtitan's ``CheckpointManager`` against the
    uninterrupted run (bit for bit, expert biases included)."""
    titan_dims_module.device_type = "cpu"
    titan_dist.set_spmd_backend("partial_dtensor")  # as its trainer sets it from the config
    dims = ParallelDims(dp_replicate=2, dp_shard=world // 2, cp=1, tp=1, pp=1, ep=2,
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    ref = _reference(arch=MOE)
    _train(ref, slice(None), world, 1, dims=dims)
    want = _full_params(ref)
    fsdp2 = _fsdp2_on(_meta_model(arch=MOE), dims, list(_reference(arch=MOE).parameters()),
                      arch=MOE)
    _train(fsdp2, rank, world, 1, dims=dims)
    fsdp2_params = _full_params(fsdp2)
    out: dict[str, float | bool | int] = {"fsdp2 vs ref": _rel(fsdp2_params, want)}
    for strategy, ac in (("hsdp", False), ("hfsdp", True)):
        model = _hsdp_model(dims, strategy, ac, arch=MOE)
        out[f"{strategy} ac={ac} expert units"] = sum(
            1 for m in model.modules() if getattr(m, "_hsdp_unit", None) is not None
            and "ep" in m._hsdp_unit.mesh.mesh_dim_names)
        out[f"{strategy} ac={ac} init vs ref"] = _rel(_full_params(model),
                                                      _full_params(_reference(arch=MOE)))
        _train(model, rank, world, 1, dims=dims)
        out[f"{strategy} ac={ac} biases moved"] = all(
            b.abs().sum() > 0 for n, b in model.named_buffers() if n.endswith("expert_bias_E"))
        got = _full_params(model)
        out[f"{strategy} ac={ac} vs ref"] = _rel(got, want)
        out[f"{strategy} ac={ac} vs fsdp2"] = _rel(got, fsdp2_params)
        hsdp.synchronize(model)
    model, losses = _titan_run(_hsdp_model(dims, "hsdp", arch=MOE), rank, world,
                               f"{root}/moe", resume=False, dims=dims)
    full = _full_params(model) + [b.clone() for b in model.buffers()]
    hsdp.synchronize(model)
    model, resumed = _titan_run(_hsdp_model(dims, "hsdp", arch=MOE), rank, world,
                                f"{root}/moe", resume=True, dims=dims)
    out["hsdp resume equal"] = resumed == losses[SAVE_AT:] and all(
        torch.equal(a, b) for a, b in zip(_full_params(model) + list(model.buffers()), full))
    hsdp.synchronize(model)
    return out
