"""The class of a fully_shard-ed module: ``HSDP<Name>``, a subclass of the module's own class
(as FSDP2 does), adding the calls users reach for and guarding the ones that would break
the sharding."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn

from hsdp.schedule import Unit, units_below

_CLASSES: dict[type, type] = {}


def adopt(module: nn.Module) -> None:
    """Make ``module`` an ``HSDPModule`` (in place); a compiled call (``module.compile()``
    made before fully_shard) becomes a compiled forward, so that hsdp's hooks stay eager."""
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"HSDP{cls.__name__}", (HSDPModule, cls), {})
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

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.double()``, ``.cuda()``, ``to_empty()``...: allowed where they leave
        hsdp's parameters as they are, refused (before anything changes) where they would
        replace them with tensors hsdp does not manage."""
        for unit in units_below(self):
            for g in unit.groups:
                for slots, p in zip(g.slots, g.sharded):
                    if fn(p) is not p:
                        raise RuntimeError(_conversion_error(unit, slots[0], p))
        return super()._apply(fn, recurse)


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
