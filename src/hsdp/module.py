"""The class of a fully_shard-ed module: ``HSDP<Name>``, a subclass of the module's own class
(as FSDP2 does), adding the calls users reach for and guarding the ones that would break
the sharding."""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from hsdp.runtime.hooks import UnshardHandle, units_below
from hsdp.runtime.unit import Unit
from hsdp.sharding.policy import check_reshard_after_forward

# Process-wide: one HSDP subclass per module class, so instances of a class share it.
_CLASSES: dict[type, type] = {}


def adopt(module: nn.Module) -> None:
    """Make ``module`` an ``HSDPModule`` (in place); a compiled call (``module.compile()``
    made before fully_shard) becomes a compiled forward, so that hsdp's hooks stay eager."""
    cls = type(module)
    _route_torch_registration()
    if cls not in _CLASSES:
        extra = ({"save_pretrained": _save_pretrained(cls)}
                 if callable(getattr(cls, "save_pretrained", None)) else {})
        _CLASSES[cls] = type(f"HSDP{cls.__name__}", (HSDPModule, cls), extra)
    module.__class__ = _CLASSES[cls]
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is not None:
        ctx = _dynamo_context(compiled)
        if ctx is None:
            raise RuntimeError(
                f"fully_shard: {cls.__name__}.compile() was called before fully_shard and "
                f"hsdp cannot move its hooks out of the compiled call; call .compile() after "
                f"fully_shard, or use torch.compile(module)")
        module._compiled_call_impl = None
        module.forward = ctx(types.MethodType(cls.forward, module))


def _save_pretrained(cls: type) -> Callable[..., Any]:
    """A ``save_pretrained`` (transformers' and the like) for the sharded model: with a
    ``state_dict`` given, ``cls``'s own, run while the sharded class bears ``cls``'s name
    (transformers writes the class name into config.json's ``architectures``, stripping
    only FSDP2's prefix); without, refused (it would read the model's parameters, which
    are this rank's shards)."""
    save = cls.save_pretrained

    @functools.wraps(save)
    def save_pretrained(self: nn.Module, *args: Any, state_dict: Any = None,
                        **kwargs: Any) -> Any:
        if state_dict is None:
            raise RuntimeError(
                f"hsdp: {type(self).__name__}.save_pretrained() without state_dict would save "
                f"this rank's shards. Gather the weights, then save on one rank: full = "
                f"hsdp.full_state_dict(model, rank0_only=True) on every rank, then on rank 0 "
                f"model.save_pretrained(path, state_dict=full)")
        sharded = type(self)
        sharded.__name__ = cls.__name__
        try:
            return save(self, *args, state_dict=state_dict, **kwargs)
        finally:
            sharded.__name__ = f"HSDP{cls.__name__}"
    return save_pretrained


def _dynamo_context(compiled: Any) -> Any:
    """The torch.compile context (backend and options) a compiled function was made with."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(compiled, "__closure__", None) or ():
        if isinstance(cell.cell_contents, _TorchDynamoContext):
            return cell.cell_contents
    return None


class HSDPModule:
    """Mixed into every module passed to ``hsdp.fully_shard``."""

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile this module's forward with ``torch.compile(*args, **kwargs)``. Unlike
        ``nn.Module.compile`` (which compiles the whole call, hooks included), hsdp's
        gather / reshard hooks stay outside the compiled region: no graph break from hsdp,
        and ``fullgraph=True`` works."""
        self.forward = torch.compile(types.MethodType(type(self).forward, self), *args,
                                     **kwargs)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now (not recursive). They stay gathered until
        the unit's next forward ends (then ``reshard_after_forward`` applies), ``reshard()``,
        or the next forward of the model's root, and are shown on the module once
        gathered (at once, or at ``handle.wait()`` with ``async_op=True``)."""
        handle = self._hsdp_unit.root_runtime().unshard(self._hsdp_unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters and show the sharded ones again."""
        self._hsdp_unit.root_runtime().reshard(self._hsdp_unit)

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        """See ``fully_shard(reshard_after_forward=...)``; ``recurse``: also for every unit
        below this one."""
        keep = check_reshard_after_forward(reshard_after_forward)
        for unit in units_below(self) if recurse else [self._hsdp_unit]:
            unit.reshard_after_forward = keep

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """True is what hsdp does (free a unit's gathered parameters after its backward).
        False (FSDP2: keep them gathered into the next microbatch) is refused."""
        if not reshard_after_backward:
            raise NotImplementedError(
                "hsdp: set_reshard_after_backward(False) is not supported: hsdp frees a "
                "unit's gathered parameters after its backward and gathers them again at "
                "the next forward (same numbers, one more all-gather per microbatch). Drop "
                "the call; to skip communication between microbatches use "
                "set_requires_gradient_sync(False)")

    def _root_unit(self, what: str, recurse: bool = True) -> Unit:
        """This module's unit, which must be the model's root (``what`` applies to the
        whole model in hsdp)."""
        unit = self._hsdp_unit
        if unit.enclosing is not None or not recurse:
            where = f"unit {unit.label}" if unit.enclosing else "the root alone"
            raise RuntimeError(f"hsdp: {what} applies to the whole model; call it on the "
                               f"root module with recurse=True, not on {where}")
        return unit

    def set_requires_all_reduce(self, requires_all_reduce: bool, *,
                                recurse: bool = True) -> None:
        """False: the following backwards reduce-scatter over inner but leave the outer
        reduction (FSDP2 HSDP's all-reduce) to the next backward with it True, whose
        gradients are then final (as ``hsdp.microbatch(model, is_last=False)``; an
        ``optimizer.step()`` in between raises). Root only."""
        self._root_unit("set_requires_all_reduce", recurse).is_last_override = (
            None if requires_all_reduce else False)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's hint that the next backwards are not the step's last: hsdp defers their
        outer reduction and the gradients' finalization to the next backward with it True
        (the same as ``set_requires_all_reduce``). Root only."""
        self._root_unit("set_is_last_backward").is_last_override = (
            None if is_last_backward else False)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: the following backwards communicate nothing; each rank adds its unsharded
        gradients (in the reduce dtype, one flat buffer per group) to a local
        accumulation, and the next backward with sync on reduces them with its own
        (``optimizer.step()`` before that raises). Applies to the whole model: call it on
        the root module."""
        unit = self._root_unit("set_requires_gradient_sync", recurse)
        unit.gradient_sync = bool(requires_gradient_sync)

    def set_gradient_divide_factor(self, factor: float | None, recurse: bool = True) -> None:
        """As FSDP2's: gradients become sums over the DP ranks divided by ``factor`` (1.0:
        plain sums, as torchtitan, which scales the loss itself), instead of means (``None``,
        the default); for every microbatch and both strategies. ``recurse``: also for every
        unit below this one."""
        if factor is not None and not factor > 0:
            raise ValueError(f"hsdp: set_gradient_divide_factor expects a positive factor or "
                             f"None, got {factor!r}")
        for unit in units_below(self) if recurse else [self._hsdp_unit]:
            for g in unit.groups:
                g.divide_factor = None if factor is None else float(factor)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None, *,
                            stream: Any = None) -> None:
        """As FSDP2's under HSDP: ``hook(reduce_output)`` runs on the outer stream right
        after this unit's outer all-reduce, on its result (this rank's gradient shard in the
        reduce dtype, before it becomes the gradient: writes into it are kept), on the
        last microbatch of each step. On one outer rank (plain FSDP) the outer all-reduce
        is kept, over that one rank, so the hook gets the reduce-scatter's result, as in
        FSDP2. This unit only (not recursive, as FSDP2); None removes it. Refused: a
        ``stream`` (hsdp runs the hook on its outer stream, as FSDP2 does under HSDP) and
        strategy hfsdp (no all-reduce: its outer reduction is a reduce-scatter)."""
        groups = self._hsdp_unit.groups
        if stream is not None:
            raise NotImplementedError(
                "hsdp: set_all_reduce_hook(stream=...) is not supported: hsdp runs the hook "
                "on its outer stream, after the outer all-reduce (as FSDP2 does under HSDP). "
                "Drop stream=; for torchft replica groups use "
                "hsdp.init_mesh(..., fault_tolerance=...)")
        if hook is not None and any(g.shard_outer for g in groups):
            raise ValueError(
                "hsdp: set_all_reduce_hook needs strategy='hsdp': hfsdp reduce-scatters the "
                "gradients over outer, there is no all-reduce for the hook to follow")
        why = [w for w in (m.hook_refusal(g) for g in groups for m in g.outer) if w]
        if hook is not None and why:
            raise ValueError(f"hsdp: set_all_reduce_hook is not supported with {why[0]}")
        for g in groups:
            g.set_all_reduce_hook(hook)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """All-gather ``modules`` (fully_shard-ed) when this unit's forward starts, instead
        of the next unit of the recorded order. More than one holds more gathered units."""
        self._hsdp_unit.prefetch["forward"] = _units(modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """As ``set_modules_to_forward_prefetch``, when this unit's backward starts."""
        self._hsdp_unit.prefetch["backward"] = _units(modules)

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.double()``, ``.cuda()``, ``to_empty()``...: allowed where they leave
        hsdp's parameters as they are, refused (before anything changes) where they would
        replace them with tensors hsdp does not manage."""
        for unit in units_below(self):
            for g in unit.groups:
                for q in g.params:
                    if fn(q.sharded) is not q.sharded:
                        raise RuntimeError(_conversion_error(unit, q.slots[0], q.sharded))
        return super()._apply(fn, recurse)


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run like its forward: parameters gathered before it,
    resharded after it (FSDP2's ``register_fsdp_forward_method``, which calls this on hsdp
    modules once one is fully_shard-ed). ``module`` must be fully_shard-ed; a unit inside
    a model runs it as its forward does, within the model's forward. Called from the
    module's own forward, it runs as it is."""
    unit = vars(module).get("_hsdp_unit")
    if unit is None:
        raise ValueError(f"hsdp.register_forward_method: {type(module).__name__} is not a "
                         f"module passed to hsdp.fully_shard")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"hsdp.register_forward_method: {type(module).__name__} has no "
                         f"method {method_name!r}")

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        if unit.shows_unsharded:  # called inside the unit's forward: already gathered
            return method(*args, **kwargs)
        args, kwargs = unit._pre_forward_hook(module, args, kwargs)
        try:
            out = method(*args, **kwargs)
        except BaseException:
            unit._forward_failed_hook(module, args, kwargs, None)
            raise
        return unit._post_forward_hook(module, args, kwargs, out)

    setattr(module, method_name, as_forward)


_TORCH_HOMES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                "torch.distributed.fsdp._fully_shard._fully_shard")


def _route_torch_registration() -> None:
    """Make torch's ``register_fsdp_forward_method`` (a no-op on modules that are not FSDP2's)
    do ``register_forward_method`` on hsdp modules; installed where torch defines and exports
    it when the first module is fully_shard-ed (importing hsdp patches nothing). A
    reference taken before that still does nothing: the error of the method's first call
    then names ``hsdp.register_forward_method``."""
    homes = [importlib.import_module(name) for name in _TORCH_HOMES]
    original = homes[-1].register_fsdp_forward_method
    if getattr(original, "_hsdp_routes", False):
        return

    @functools.wraps(original)
    def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
        if "_hsdp_unit" in vars(module):
            register_forward_method(module, method_name)
        else:
            original(module, method_name)

    register_fsdp_forward_method._hsdp_routes = True
    for home in homes:
        home.register_fsdp_forward_method = register_fsdp_forward_method


def _units(modules: list[nn.Module]) -> list[Unit]:
    units = [getattr(m, "_hsdp_unit", None) for m in modules]
    if any(u is None for u in units):
        raise ValueError("hsdp: prefetch targets must be modules passed to hsdp.fully_shard")
    return units


def _conversion_error(unit: Unit, slot: tuple[nn.Module, str], p: torch.Tensor) -> str:
    path = {id(m): n for n, m in unit.module.named_modules()}.get(id(slot[0]), "?")
    name = f"{path}.{slot[1]}" if path else slot[1]
    if p.is_meta:
        return (f"hsdp: parameter {name} of unit {unit.label} is on the meta device; allocate and "
                f"initialize the sharded model with hsdp.materialize(model, init_fn) instead "
                f"of to_empty() / .to()")
    return (f"hsdp: converting parameter {name} of unit {unit.label} ({p.dtype}, {p.device}) after "
            f"fully_shard would replace it with a tensor hsdp does not manage. Change "
            f"dtype / device before fully_shard; for a compute dtype use "
            f"hsdp.MixedPrecision(param_dtype=...)")
