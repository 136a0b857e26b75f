"""Public API: fully_shard, microbatch, synchronize."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import OffloadPolicy

from hsdp.checkpoint import torch_state_dict
from hsdp.checkpoint.dcp import finish_saves
from hsdp.checkpoint.state_dicts import load_state_dict_hook, state_dict_hook
from hsdp.ft.errors import FaultToleranceError
from hsdp.module import adopt
from hsdp.outer_auto import Auto
from hsdp.runtime.hooks import units_below
from hsdp.runtime.optim_hooks import watch_optimizers
from hsdp.runtime.outer_modes import as_mode
from hsdp.runtime.unit import Unit
from hsdp.sharding.float8_weights import float8_dtype
from hsdp.sharding.group import ParamGroup, Slot, owner
from hsdp.sharding.outer_gather import OuterGather
from hsdp.sharding.outer_reduce import OuterReduce
from hsdp.sharding.policy import (
    MixedPrecision,
    Strategy,
    as_mixed_precision,
    check_reshard_after_forward,
)
from hsdp.sharding.tp_blocks import check_params
from hsdp.topology.communicators import comm_groups
from hsdp.topology.mesh_dims import as_hsdp_mesh
from hsdp.topology.outer_mode import outer_sync_of

# Process-wide: unit labels number the fully_shard calls of the process, the same on every rank.
_UNIT_IDS = itertools.count()


def fully_shard(module: nn.Module, *, mesh: DeviceMesh, strategy: Strategy | str = "hsdp",
                mp_policy: MixedPrecision | None = None, overlap_outer: bool = True,
                reshard_after_forward: bool | None = True,
                outer_reduce: OuterReduce | Auto | str | None = None,
                outer_gather: OuterGather | str | None = None,
                offload_policy: OffloadPolicy | None = None) -> nn.Module:
    """Shard the parameters ``module`` owns (those not owned by an already sharded
    submodule) over ``mesh``. Call bottom-up: units first, the root last. ``module``
    becomes an ``HSDPModule`` (see ``module.py`` for the methods it gains).

    strategy: ``hsdp.Strategy`` or its value, "hsdp" (shard over inner, replicate over
    outer) or "hfsdp" (gradients and optimizer state sharded over outer too).
    ``overlap_outer=False`` issues the outer reduction on the inner reduce-scatter stream
    (the serialized baseline).
    ``reshard_after_forward=False`` keeps the unit's gathered parameters from its forward
    to its backward (no re-gather; more memory), as FSDP2's option of that name (its
    None means True here; its int is refused). ``mp_policy`` may also be torch's
    ``MixedPrecisionPolicy``; ``mesh`` a 1-D mesh (outer=1) or one with torchtitan's dim
    names ``("dp_replicate", "dp_shard")``, or hsdp's 3-D ("outer", "inner", "tp") mesh
    after torch's ``parallelize_module`` on ``mesh["tp"]`` (hsdp shards each parameter's
    TP-local tensor; see ``sharding/tp_blocks.py``). ``outer_reduce=hsdp.OuterReduce(...)``
    compresses the outer gradient reduction to 8 bits with error feedback
    (docs/guide/slow_outer_links.md); None: the exact reduction; ``hsdp.Auto(...)``
    (``hsdp_tools.auto(model)``): as its chooser decides for ``mesh`` (``outer_auto.py``).
    ``outer_gather=hsdp.OuterGather(...)`` (strategy="hfsdp" only) compresses the outer
    all-gather of the updated weights after each optimizer step to 8 bits blockwise: the
    fp32 main weights stay exact, the gathered ones are their dequantized form, the same
    on every rank (same guide); None: the exact gather. ``offload_policy``:
    FSDP2's; only its default ``OffloadPolicy()`` (no offload) is accepted, CPU offload
    raises.

    A module whose parameters are all on the meta device gets meta shards and buffers
    (no memory, no data): ``hsdp sim`` runs the schedule on such models.
    """
    strategy = Strategy.parse(strategy)
    _check_offload_policy(offload_policy)
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward)
    mp = as_mixed_precision(mp_policy)
    if isinstance(outer_reduce, str) and outer_reduce == "auto":
        raise ValueError("fully_shard: outer_reduce='auto' takes its chooser: "
                         "outer_reduce=hsdp_tools.auto(model) (an hsdp.Auto; the same object "
                         "as init_mesh(outer_sync=...)), docs/guide/slow_outer_links.md")
    if isinstance(outer_reduce, Auto):
        outer_reduce = outer_reduce.outer_reduce_for(as_hsdp_mesh(mesh))
    outer_reduce = as_mode("outer_reduce", outer_reduce)
    outer_gather = as_mode("outer_gather", outer_gather)
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module)}")
    if getattr(module, "_hsdp_unit", None) is not None:
        raise RuntimeError(f"fully_shard was already applied to this {type(module).__name__}")
    # the outer modes, each hooked where the outer axis is handled (runtime/outer_modes.py)
    modes = tuple(m for m in (outer_sync_of(mesh), outer_reduce, outer_gather) if m is not None)
    mesh = as_hsdp_mesh(mesh)
    comms = comm_groups(mesh)
    if comms.elastic is not None and strategy is Strategy.HFSDP:
        raise FaultToleranceError(
            "fully_shard: strategy='hfsdp' cannot be made fault tolerant: its optimizer "
            "state is sharded over the outer axis, so a lost replica group takes state no "
            "other group holds. Use strategy='hsdp' with init_mesh(fault_tolerance=...)")
    device = (torch.device("cuda", torch.cuda.current_device())
              if mesh.device_type == "cuda" else torch.device(mesh.device_type))
    watch_optimizers()
    torch_state_dict.install()  # torch's state-dict functions learn hsdp's Pieces

    # torch.compile(module) made before fully_shard: hooks go on the wrapper (outside the
    # compiled region), the unit and the hsdp methods on the module it wraps.
    inner = module._orig_mod if isinstance(module, OptimizedModule) else module
    params, slots, ties = _owned_params(module)
    check_params(params, _names(inner, slots), mesh)
    for mode in modes:
        mode.check_shard(strategy, comms, device, params, _names(inner, slots))
    meta = [p.is_meta for p in params]
    if any(meta) and not all(meta):
        raise RuntimeError(f"fully_shard: some parameters of this {type(inner).__name__} are "
                           f"on the meta device and some are not; build it on one device")
    # Meta parameters: the shards stay on meta (no data touched) until hsdp.materialize.
    shard_device = torch.device("meta") if params and all(meta) else device
    keyed: dict[tuple, tuple[list[nn.Parameter], list[list[Slot]]]] = {}
    for p, s in zip(params, slots):
        ps, ss = keyed.setdefault((p.dtype, p.requires_grad, float8_dtype(p)), ([], []))
        ps.append(p)
        ss.append(s)
    label = f"{type(inner).__name__}{next(_UNIT_IDS)}"  # same on every rank
    groups = [
        ParamGroup(f"{label}/{k}", ps, ss, comms, shard_device, strategy, mp, modes)
        for k, (ps, ss) in enumerate(keyed.values())]
    for g in groups:
        g.use_sharded()
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                m._buffers[name] = b.to(device)
    unit = Unit(module, label, groups, mesh, device, overlap_outer, mp, reshard_after_forward)
    unit.description = _describe(inner, params, slots, strategy=strategy.value, mp_policy=mp,
                                 overlap_outer=overlap_outer,
                                 reshard_after_forward=reshard_after_forward,
                                 outer_reduce=outer_reduce, outer_gather=outer_gather)
    for nested in units_below(module):
        if nested.enclosing is None and nested is not unit:
            nested.enclosing = unit
    for group, idx, slot in ties:
        unit.borrow(group, idx, slot)
    adopt(inner)
    inner._hsdp_unit = unit
    inner.register_state_dict_post_hook(state_dict_hook)
    inner.register_load_state_dict_pre_hook(load_state_dict_hook)
    return module


def _check_offload_policy(policy: OffloadPolicy | None) -> None:
    """FSDP2's ``offload_policy``: None or its no-offload default ``OffloadPolicy()``."""
    if policy is None or type(policy) is OffloadPolicy:
        return
    raise NotImplementedError(
        f"fully_shard: offload_policy={type(policy).__name__}(...) is not supported: hsdp "
        f"keeps parameters, gradients and optimizer state on the device (no CPU offload "
        f"yet). Drop offload_policy; to fit a larger model use more ranks per inner group, "
        f"strategy='hfsdp' (optimizer state sharded over outer too) or activation "
        f"checkpointing.")


Tie = tuple[ParamGroup, int, Slot]


def _names(module: nn.Module, slots: list[list[Slot]]) -> list[str]:
    """Each parameter's first name under ``module``."""
    path = {id(m): n for n, m in module.named_modules()}
    return [f"{path.get(id(m), '?')}.{name}".lstrip(".") for (m, name), *_ in slots]


def _describe(module: nn.Module, params: list[nn.Parameter], slots: list[list[Slot]],
              **options: object) -> list[str]:
    """This fully_shard call as every rank must have made it: the options, then each
    parameter's name, shape, dtype and requires_grad (compared at the first forward)."""
    path = {id(m): n for n, m in module.named_modules()}
    lines = [f"{type(module).__name__} with "
             + ", ".join(f"{k}={v!r}" for k, v in options.items())]
    for p, ((m, name), *_) in zip(params, slots):
        where = path.get(id(m), "?")
        lines.append(f"parameter {where + '.' if where else ''}{name}: shape "
                     f"{tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}")
    return lines


def _owned_params(module: nn.Module) -> tuple[list[nn.Parameter], list[list[Slot]], list[Tie]]:
    """Parameters not yet managed by hsdp, each once, with every (module, name) slot; and
    the slots still holding a parameter that another unit's group took over (a tie across
    units: that group stays its owner, this unit borrows it)."""
    nested = {g for u in units_below(module) for g in u.groups}
    params: list[nn.Parameter] = []
    slots: dict[int, list[Slot]] = {}
    ties: list[Tie] = []
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is None:
                continue
            moved = getattr(p, "_hsdp_moved_to", None)
            if moved is not None:
                ties.append((*moved, (m, name)))
                continue
            managed = owner(p)
            if managed is not None:
                if managed[0] not in nested:
                    raise RuntimeError(
                        f"fully_shard: {type(m).__name__}.{name} is already sharded by an "
                        f"enclosing unit; apply fully_shard bottom-up (submodules first, the "
                        f"root last)")
                continue
            if id(p) not in slots:
                params.append(p)
                slots[id(p)] = []
            slots[id(p)].append((m, name))
    return params, [slots[id(p)] for p in params], ties


def _root_unit(model: nn.Module) -> Unit:
    unit = getattr(model, "_hsdp_unit", None)
    if unit is None:
        raise ValueError("expected the root module passed to hsdp.fully_shard")
    if unit.enclosing is not None:
        raise ValueError(f"expected the root module (the outermost fully_shard-ed module), got "
                         f"{unit.label}, which is part of a larger sharded model")
    return unit


@contextmanager
def microbatch(model: nn.Module, is_last: bool) -> Iterator[None]:
    """Gradient accumulation: inner reduce-scatter on every microbatch, the outer
    reduction only on the one with ``is_last=True``. For no communication at all on some
    microbatches, see ``HSDPModule.set_requires_gradient_sync``."""
    unit = _root_unit(model)
    if unit.is_last_override is not None:
        raise RuntimeError("hsdp.microbatch contexts cannot be nested, nor used while "
                           "set_requires_all_reduce(False) / set_is_last_backward(False) "
                           "is in effect")
    unit.is_last_override = bool(is_last)
    try:
        yield
    finally:
        unit.is_last_override = None


def synchronize(model: nn.Module) -> None:
    """Block until hsdp's pending work for ``model`` has finished, e.g. the HFSDP outer
    all-gather that ``optimizer.step()`` issued, and every asynchronous ``hsdp.save`` is
    published (raising its error, if it failed, on every rank). Call it before
    ``torch.distributed.destroy_process_group()``: destroying a process group under a
    running collective aborts the process."""
    rt = _root_unit(model).runtime
    if rt is not None:
        rt.synchronize()
    finish_saves()


def precompute_float8_scales(model: nn.Module) -> None:
    """Compute the scales of every torchao float8 weight of ``model`` (float8 all-gather
    on) from the weights as they are now: one MAX all-reduce for all of them
    (``sharding/float8_weights.py``). hsdp does this itself after each ``optimizer.step()``; call
    it on every rank after changing the weights any other way (loading a checkpoint,
    editing them). torchao's ``precompute_float8_dynamic_scale_for_fsdp`` is FSDP2's."""
    _root_unit(model).root_runtime().refresh_float8_scales()
