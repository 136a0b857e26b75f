"""hsdp as torchtitan's (0.3.0) data-parallel backend, through torchtitan's own extension
points: a ``parallelize_fn`` (``parallelize_llama``) and a config registry module, so
that torchtitan's trainer runs unchanged::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module hsdp.integrations.torchtitan --config llama3_debugmodel

Every ``llama3_*`` config of ``torchtitan.models.llama3.config_registry`` and every
``deepseek_v3_*`` one (mixture-of-experts) is available here, with the model spec renamed
``hsdp_<model>``, its ``parallelize_fn`` replaced and, for ``pipeline_parallel_degree > 1``,
its ``pipelining_fn`` (``torchtitan_pipeline.py``). ``dp_replicate`` is hsdp's outer
axis, ``dp_shard`` its inner one. With ``expert_parallel_degree`` ep > 1 torchtitan splits
the experts over ep (its token dispatch) and hsdp shards each block's experts on the
expert mesh ``hsdp.expert_mesh(mesh, ep)`` (torchtitan's ``dp_replicate, efsdp, ep``),
nested in the block's unit. The job config's ``hsdp`` section
(``--hsdp.strategy``, ``--hsdp.overlap_outer``, ``--hsdp.outer_reduce``,
``--hsdp.outer_sync``: ``torchtitan_config.py``) picks the strategy, the compressed outer
reduction (docs/guide/slow_outer_links.md) and DiLoCo on the outer axis
(docs/guide/across_datacenters.md). Gradients are sums over the DP ranks
(``set_gradient_divide_factor(1.0)``, as torchtitan sets on FSDP2: it divides the loss by
the global token count itself); with DiLoCo, sums over the replica's ranks times the
number of replicas (each replica's gradient is its own mean, on torchtitan's scale).
torchao float8 linears (torchtitan's float8 converter, or ``torchtitan_float8``'s with
float8 all-gather) train under hsdp; other torchao modules (MX, NVFP4) are refused.
torchtitan's ``CheckpointManager`` saves and loads the outer modes' state (the compressed
reduction's residuals, DiLoCo's state) with the optimizer's state
(``OptimizersContainer``'s state dict, here given hsdp's entries:
``checkpoint/extra_state.py``); its load then lets each mode put back what the model's
entries wrote over (each DiLoCo replica's own parameters, where the model's entries are
outer replica 0's), so a resume in the middle of a period is exact on every replica.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.checkpoint import OPTIMIZER, CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
from torchtitan.models.common.attention import FusedQKVLinear
from torchtitan.models.deepseek_v3 import config_registry as _deepseek_v3_configs
from torchtitan.models.llama3 import config_registry as _llama3_configs
from torchtitan.protocols.module import Module as TitanModule

import hsdp
from hsdp.checkpoint import extra_state
from hsdp.checkpoint.state_dicts import load_state_dict_hook
from hsdp.integrations.torchtitan_config import as_hsdp_config, refuse_old_env
from hsdp.integrations.torchtitan_pipeline import check_pipeline, pipeline_llama
from hsdp.runtime.outer_modes import parse_mode
from hsdp.sharding.policy import Strategy


def _check_supported(model: nn.Module, parallel_dims: ParallelDims, training: TrainingConfig,
                     parallelism: ParallelismConfig, mesh: DeviceMesh | None) -> None:
    """Refuse (before anything changes) what hsdp cannot do under torchtitan, naming what
    to use instead."""
    if parallel_dims.pp_enabled:
        check_pipeline(parallelism)
        if mesh is None:
            raise ValueError("hsdp's parallelize_llama under pipeline parallelism needs its "
                             "stage's mesh: use hsdp.integrations.torchtitan_pipeline."
                             "pipeline_llama as the model spec's pipelining_fn (with_hsdp's "
                             "configs do)")
    converted = sorted({type(m).__name__ for m in model.modules()
                        if _is_torchao(m) and not _is_float8_linear(m)})
    if converted:
        raise ValueError(f"hsdp's torchtitan integration supports torchao's float8 linears "
                         f"only, not {', '.join(converted)} (torchtitan's MX / NVFP4 "
                         f"converters rely on FSDP2's all-gather hooks); use "
                         f"hsdp.integrations.torchtitan_float8.Float8LinearConverter or "
                         f"torchtitan's own llama3 module (FSDP2)")
    refused = {
        "context_parallel_degree > 1": parallel_dims.cp_enabled,
        # torchtitan's experts then split over tp inside the ep mesh (its etp)
        "expert_parallel_degree > 1 with tensor_parallel_degree > 1":
            parallel_dims.ep_enabled and parallel_dims.tp_enabled,
        # pipeline_llama splits Llama3's decoder; a MoE model's stages are not built yet
        "expert_parallel_degree > 1 with pipeline_parallel_degree > 1":
            parallel_dims.ep_enabled and parallel_dims.pp_enabled,
        "training.enable_cpu_offload": training.enable_cpu_offload,
        "parallelism.enable_fsdp_symm_mem": parallelism.enable_fsdp_symm_mem,
    }
    bad = [k for k, on in refused.items() if on]
    if bad:
        raise ValueError(f"hsdp's torchtitan integration does not support {', '.join(bad)}; "
                         f"use torchtitan's own llama3 module (FSDP2) for those")
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(f"hsdp's torchtitan integration needs --parallelism.spmd_backend "
                         f"partial_dtensor (got {parallelism.spmd_backend!r}): hsdp shards "
                         f"plain parameters, not spmd_types / full-DTensor annotated ones")


def _is_torchao(m: nn.Module) -> bool:
    return any(c.__module__.startswith("torchao.") for c in type(m).__mro__)


def _is_float8_linear(m: nn.Module) -> bool:
    """torchao's (tensorwise or rowwise) float8 linear; a model can hold one only once
    torchao is imported: no import here."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    return float8_linear is not None and isinstance(m, float8_linear.Float8Linear)


def parallelize_llama(model: nn.Module, *, parallel_dims: ParallelDims,
                      training: TrainingConfig, parallelism: ParallelismConfig,
                      compile_config: CompileConfig,
                      ac_config: ActivationCheckpointingConfig | None, dump_folder: str,
                      strategy: Strategy | str = "hsdp", overlap_outer: bool = True,
                      outer_reduce: hsdp.OuterReduce | str | None = None,
                      outer_sync: hsdp.DiLoCo | str | None = None,
                      mesh: DeviceMesh | None = None) -> nn.Module:
    """torchtitan's ``parallelize_llama`` with hsdp in place of ``apply_fsdp_to_decoder``:
    torchtitan's own TP plan or expert parallelism (the model's ``parallelize`` on its "tp"
    / "ep" meshes, when ``tensor_parallel_degree`` / ``expert_parallel_degree > 1``),
    activation checkpointing and per-block compile as torchtitan applies them, then one
    hsdp unit per block (and one for the embedding unless it is tied to the output), the
    norm and output head in the root's; with expert parallelism each MoE block's experts
    in a unit of their own on the expert mesh, inside the block's. ``strategy`` /
    ``overlap_outer`` / ``outer_reduce`` / ``outer_sync``: ``fully_shard``'s (and
    ``init_mesh``'s); torchtitan's trainer passes its ``--hsdp.*`` settings
    (``HsdpTrainer``). ``mesh``: the stage's mesh under pipeline
    parallelism (``pipeline_llama`` passes it), else ``hsdp.init_mesh``'s over the world."""
    refuse_old_env()
    _check_supported(model, parallel_dims, training, parallelism, mesh)
    if any(_is_float8_linear(m) for m in model.modules()):
        from hsdp.integrations.torchtitan_float8 import wrap_float8_all_gather_weights

        wrap_float8_all_gather_weights(model)
    strategy = Strategy.parse(strategy)
    if isinstance(outer_sync, str):
        outer_sync = parse_mode("outer_sync", outer_sync)
    if outer_sync is not None and mesh is not None:
        raise NotImplementedError(
            "hsdp: DiLoCo (--hsdp.outer_sync / outer_sync) with pipeline_parallel_degree > 1 "
            "is not supported: train DiLoCo without pipeline parallelism")
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)

    if mesh is None:
        mesh = hsdp.init_mesh(parallel_dims.dp_replicate, parallel_dims.dp_shard,
                              parallel_dims.world_mesh.device_type, tp=parallel_dims.tp,
                              outer_sync=outer_sync)
    mp = hsdp.MixedPrecision(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                             reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
                             cast_forward_inputs=False)
    shard = functools.partial(hsdp.fully_shard, mesh=mesh, strategy=strategy, mp_policy=mp,
                              overlap_outer=overlap_outer, outer_reduce=outer_reduce)
    policy = parallelism.fsdp_reshard_after_forward
    reshard = get_fsdp_reshard_after_forward_policy(policy, pp_enabled=parallel_dims.pp_enabled)
    # first: expert_mesh refuses what the experts' units cannot serve, before any unit
    experts_mesh = (hsdp.expert_mesh(mesh, parallel_dims.ep) if parallel_dims.ep_enabled
                    else None)
    if model.tok_embeddings is not None and not model.enable_weight_tying:
        shard(model.tok_embeddings, reshard_after_forward=reshard)
    for block in model.layers.values():
        if experts_mesh is not None and getattr(block, "moe_enabled", False):
            shard(block.moe.routed_experts.inner_experts, mesh=experts_mesh,
                  reshard_after_forward=reshard)
        shard(block, reshard_after_forward=reshard)
    # torchtitan's [norm, lm_head] unit: resharded only under "always"
    shard(model, reshard_after_forward=policy == "always")
    # torchtitan divides the loss by the tokens of every DP rank; a DiLoCo replica sums
    # over its own ranks only
    model.set_gradient_divide_factor(1.0 if outer_sync is None
                                     else 1.0 / parallel_dims.dp_replicate)
    _adopt_meta_init(model)
    _load_merged_qkv(model)
    return model


def _load_merged_qkv(model: nn.Module) -> None:
    """torchtitan's ``FusedQKVLinear`` checkpoints ``wqkv`` as ``wq`` / ``wk`` / ``wv`` and
    merges them back in its own load pre-hook, which runs after hsdp's (registered on the
    enclosing unit, above it) and yields a replicated DTensor: hand that full value to
    hsdp's hook once the merge has made it."""
    units = {name: m for name, m in model.named_modules() if hasattr(m, "_hsdp_unit")}
    for name, m in model.named_modules():
        if isinstance(m, FusedQKVLinear):
            unit = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
            m.register_load_state_dict_pre_hook(functools.partial(
                _load_qkv_into_unit, unit=units[unit],
                rel_len=len(name) - len(unit) - (unit != "")))


def _load_qkv_into_unit(module: nn.Module, state_dict: dict, prefix: str, *_: object,
                        unit: nn.Module, rel_len: int) -> None:
    for key in (f"{prefix}wqkv.weight", f"{prefix}wqkv.bias"):
        value = state_dict.get(key)
        if isinstance(value, DTensor) and all(p.is_replicate() for p in value.placements):
            state_dict[key] = value.to_local()
    load_state_dict_hook(unit, state_dict, prefix[:len(prefix) - rel_len - 1])


class _MetaInit:
    """torchtitan's trainer allocates a meta-built model with ``to_empty`` and fills it with
    ``init_weights``: on an hsdp model, the first keeps the shards on meta and the second
    runs ``hsdp.materialize`` with each torchtitan module's own initializers (in
    ``model.modules()`` order, not ``init_states``' children-first order: the random
    values differ from torchtitan's, not their distributions)."""

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> nn.Module:
        want = self._hsdp_unit.device
        if device is not None and torch.device(device).type != want.type:
            raise ValueError(f"hsdp: to_empty(device={device}) on a model sharded on {want}")
        return self

    def init_weights(self, buffer_device: torch.device | None = None, **_: object) -> None:
        hsdp.materialize(self, functools.partial(_init_own_states, buffer_device=buffer_device))


def _init_own_states(m: nn.Module, buffer_device: torch.device | None) -> None:
    """One module's part of torchtitan's ``init_states``: its parameters, then its buffers,
    a buffer that TP made a DTensor (the RoPE cache) distributed again as before (its
    initializer assigns a plain tensor)."""
    if isinstance(m, TitanModule):
        m._init_self_parameters()
        placed = {name: (b.device_mesh, b.placements) for name, b in m._buffers.items()
                  if isinstance(b, DTensor)}
        m._init_self_buffers(buffer_device=buffer_device)
        for name, (mesh, placements) in placed.items():
            b = m._buffers.get(name)
            if b is not None and not isinstance(b, DTensor):
                m.register_buffer(name, distribute_tensor(b, mesh, list(placements)),
                                  persistent=name not in m._non_persistent_buffers_set)


# Process-wide: one made subclass per model class, so instances of a class share it.
_META_CLASSES: dict[type, type] = {}


def _adopt_meta_init(model: nn.Module) -> None:
    cls = type(model)
    if cls not in _META_CLASSES:
        _META_CLASSES[cls] = type(cls.__name__, (_MetaInit, cls), {})
    model.__class__ = _META_CLASSES[cls]


def _carry_extra_state(container: type) -> None:
    """torchtitan's optimizer container (flat, FQN-keyed state dicts built from each
    optimizer's ``state`` and ``param_groups`` alone) with the outer modes' state of each
    model part added as flat keys, and set after its load (checked before
    it: another layout's raise with nothing changed). A model without them: unchanged."""
    get, load = container.state_dict, container.load_state_dict
    if getattr(get, "_hsdp", False):
        return

    @functools.wraps(get)
    def state_dict(self: OptimizersContainer) -> dict:
        out = get(self)
        live = extra_state.merged_state(self.optimizers)
        for model in self.model_parts:
            out.update(extra_state.flat(extra_state.extra_state(model, live)))
        return out

    @functools.wraps(load)
    def load_state_dict(self: OptimizersContainer, state_dict: dict) -> None:
        rest, extras = extra_state.split(state_dict)
        live = extra_state.merged_state(self.optimizers)
        loaded = [extra_state.prepare(m, extras, live, "torchtitan's checkpoint load")
                  for m in self.model_parts]
        load(self, rest)
        live = extra_state.merged_state(self.optimizers)
        for model, done in zip(self.model_parts, loaded):
            extra_state.apply(model, done, live)
        pending = getattr(self, _REPLICAS, None)
        if pending is not None:  # inside CheckpointManager.dcp_load: see _replicas_last
            pending.extend(zip(self.model_parts, loaded))

    state_dict._hsdp = True
    container.state_dict, container.load_state_dict = state_dict, load_state_dict


_REPLICAS = "_hsdp_replicas_to_restore"


def _replicas_last(manager: type) -> None:
    """torchtitan's ``CheckpointManager.dcp_load`` reads a checkpoint into one flat dict,
    loads the optimizer container from it (which puts back each DiLoCo replica's own
    parameters, ``hsdp_outer_sync``) and then the model from the same dict, whose entries
    are outer replica 0's: ``FusedQKVLinear``'s merge writes replica 0's ``wqkv`` over the
    replica's own. Within one ``dcp_load`` the container's load records what it read, and
    once the model's load is done those replica-local values are put back. The record
    exists only during that call (a load of anything else never sees it)."""
    load = manager.dcp_load
    if getattr(load, "_hsdp", False):
        return

    @functools.wraps(load)
    def dcp_load(self: CheckpointManager, state_dict: dict, *args: Any, **kwargs: Any) -> None:
        container = state_dict.get(OPTIMIZER)
        if not isinstance(container, OptimizersContainer):
            return load(self, state_dict, *args, **kwargs)
        pending: list[tuple[nn.Module, dict]] = []
        setattr(container, _REPLICAS, pending)
        try:
            load(self, state_dict, *args, **kwargs)
            live = extra_state.merged_state(container.optimizers)
            for model, done in pending:
                extra_state.restore_after_model_load(model, done, live)
        finally:
            delattr(container, _REPLICAS)
        return None

    dcp_load._hsdp = True
    manager.dcp_load = dcp_load


_carry_extra_state(OptimizersContainer)
_replicas_last(CheckpointManager)


def with_hsdp(config_fn: Callable) -> Callable:
    """``config_fn`` (a torchtitan config function) with its model spec parallelized by
    hsdp and hsdp's ``--hsdp.*`` section in its config (``HsdpTrainer.Config``): for
    config modules of your own. torchtitan's ``ChunkedLossWrapper`` becomes its
    inner loss (the same values): it calls the output head outside the model's forward,
    relying on FSDP2 grouping ``[norm, lm_head]`` in a unit of their own, which hsdp's
    ``fully_shard`` (one module per unit) does not do. Without CUDA, CUDA graphs are off
    (``training.disable_cuda_graphs``: torchtitan refuses them with pipeline or expert
    parallelism even where no graph can be captured)."""
    @functools.wraps(config_fn)
    def config():
        cfg = as_hsdp_config(config_fn())
        cfg.model_spec = dataclasses.replace(cfg.model_spec,
                                             name=f"hsdp_{cfg.model_spec.name}",
                                             parallelize_fn=parallelize_llama,
                                             pipelining_fn=pipeline_llama)
        cfg.parallelism.spmd_backend = "partial_dtensor"
        if not torch.cuda.is_available():  # no CUDA graphs; torchtitan would refuse pp / ep
            cfg.training.disable_cuda_graphs = True
        if isinstance(cfg.loss, ChunkedLossWrapper.Config):
            cfg.loss = cfg.loss.loss_fn
        return cfg
    return config


_CONFIGS = {name: with_hsdp(fn)
            for prefix, module in (("llama3_", _llama3_configs),
                                   ("deepseek_v3_", _deepseek_v3_configs))
            for name, fn in vars(module).items() if name.startswith(prefix) and callable(fn)}


def __getattr__(name: str) -> Callable:
    """torchtitan's ``--module hsdp.integrations.torchtitan --config NAME`` looks up NAME."""
    if name in _CONFIGS:
        return _CONFIGS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_CONFIGS])
