"""Elementwise ops on sharded tensors run on their local tensors (``Piece``'s fast path).

Optimizers and ``zero_grad`` run elementwise ops (foreach lists, fused kernels, single
tensors) on parameters, gradients and state whose pieces line up position by position:
the same op on the local tensors is then exactly the distributed one, without DTensor's
re-wrapping and sharding propagation per tensor and op. ``like`` makes a new result a
DTensor laid out like the argument it was computed from (a Piece where that is one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from hsdp.sharding.reductions import DECLINED

Like = Callable[[DTensor, torch.Tensor, DTensorSpec], DTensor]

# Elementwise ops that optimizers and zero_grad run on parameters, gradients and state, as
# ``__torch_function__`` sees them (torch functions and Tensor methods): on pieces laid out
# alike, the same op on the local tensors (see ``Piece``).
_ELEMENTWISE_NAMES = (
    *(f"_foreach_{n}{s}" for n in ("add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp",
                                   "sqrt", "maximum", "neg", "abs", "sign", "clamp_min",
                                   "clamp_max") for s in ("", "_")),
    "_foreach_copy_", "_foreach_zero_", "_fused_adam_", "_fused_adamw_", "_fused_sgd_",
    "_fused_adagrad_", "add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_",
    "zero_")
# Out of place on one tensor, as torch functions and Tensor methods (the per-parameter
# optimizers: ``exp_avg_sq.sqrt() / c``, ``grad.add(p, alpha=wd)``, ``-grad``).
SINGLE = frozenset(getattr(ns, n) for n in ("sqrt", "div", "add", "sub", "mul", "neg")
                   for ns in (torch, torch.Tensor))
ELEMENTWISE = frozenset(f for f in (getattr(torch, n, None) or getattr(torch.Tensor, n, None)
                                    for n in _ELEMENTWISE_NAMES) if f is not None) | SINGLE


# Reads of a tensor's attributes and metadata, which write nothing and are no op on its
# elements: what optimizers ask of every parameter each step (``p.grad``,
# ``torch.is_complex(p)``, ``p.grad.is_sparse``). ``Piece.__torch_function__`` hands them to
# torch at once: none of its checks applies to them, and they are most of its calls.
READS = frozenset({
    *(getattr(torch.Tensor, n).__get__ for n in (
        "grad", "is_sparse", "device", "dtype", "requires_grad", "is_leaf", "layout",
        "shape", "ndim", "is_cuda")),
    torch.is_complex, torch.is_floating_point, torch.Tensor.is_complex,
    torch.Tensor.is_floating_point, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.size})


def _aligned(s: DTensorSpec, r: DTensorSpec | None) -> bool:
    return s is r or (r is not None and s.placements == r.placements and s.shape == r.shape
                      and s.mesh == r.mesh)


def _local_arg(a, spec: DTensorSpec | None):
    """An argument as the local op takes it (``spec``: the first argument's at its
    position, ``None`` where that is a plain tensor): the local tensor of a DTensor
    aligned with it, a plain scalar tensor or a non-tensor as is, else ``DECLINED``."""
    if isinstance(a, DTensor):
        return a._local_tensor if _aligned(a._spec, spec) else DECLINED
    if isinstance(a, torch.Tensor):
        return DECLINED if a.dim() else a
    return DECLINED if isinstance(a, (list, tuple)) else a


def _on_local(func, args: tuple, kwargs: dict, like: Like):
    """``on_locals`` for an op on single tensors (a per-parameter optimizer's), without its
    lists: the first argument a DTensor, the other tensors DTensors aligned with it or
    scalars. An out-of-place op whose result does not have the first's local shape and
    dtype (a type promotion, a broadcast) or that is given ``out=`` is ``DECLINED``."""
    first = args[0]
    if not isinstance(first, DTensor):
        return DECLINED
    spec = first._spec
    new_args = [first._local_tensor]
    for a in args[1:]:
        a = _local_arg(a, spec)
        if a is DECLINED:
            return DECLINED
        new_args.append(a)
    new_kwargs = {}
    for k, a in kwargs.items():
        a = new_kwargs[k] = _local_arg(a, spec)
        if a is DECLINED or k == "out":
            return DECLINED
    out = func(*new_args, **new_kwargs)
    if func not in SINGLE:  # in place: self
        return first
    held = new_args[0]
    if out.dtype != held.dtype or out.shape != held.shape:
        return DECLINED
    return like(first, out, spec)


def on_locals(func, args: tuple, kwargs: dict, like: Like):
    """``func`` run on the local tensors of its DTensor arguments, or ``DECLINED`` unless
    every DTensor lines up with the others at its position (same placements, mesh and
    global shape; foreach lists position by position) and every plain tensor is a scalar.
    Then the local op is exactly the distributed one: elementwise over aligned pieces."""
    if args and not isinstance(args[0], (list, tuple)):
        return _on_local(func, args, kwargs, like)
    refs: list | None = None  # the spec at each position of the first list
    first: list | None = None  # the first list itself

    def unwrap(a):
        nonlocal refs, first
        tensors = [a] if isinstance(a, torch.Tensor) else a
        if not (isinstance(tensors, (list, tuple)) and tensors
                and isinstance(tensors[0], torch.Tensor)):
            return a
        # Fast path (the optimizer's lists: all DTensors, specs equal position by
        # position, mostly the same objects, which list equality checks first): list
        # comprehensions instead of a Python loop with a call per tensor.
        if refs is None:
            first = tensors
            try:  # all DTensors: aligned with themselves
                refs, aligned = [t._spec for t in tensors], True
            except AttributeError:  # a plain tensor (only scalars are allowed)
                refs = [t._spec if isinstance(t, DTensor) else None for t in tensors]
                aligned = False
        elif len(tensors) != len(refs):
            return DECLINED
        else:
            try:
                aligned = [t._spec for t in tensors] == refs
            except AttributeError:
                aligned = False
        if aligned:
            locals_ = [t._local_tensor for t in tensors]
            return locals_[0] if isinstance(a, torch.Tensor) else locals_
        out = []
        for t, r in zip(tensors, refs):
            t = _local_arg(t, r)
            if t is DECLINED:
                return DECLINED
            out.append(t)
        return out[0] if isinstance(a, torch.Tensor) else out

    new_args = [unwrap(a) for a in args]
    new_kwargs = {k: unwrap(v) for k, v in kwargs.items()}
    if any(a is DECLINED for a in (*new_args, *new_kwargs.values())):
        return DECLINED
    if func.__name__.endswith("_"):  # in place (foreach ops return None)
        return func(*new_args, **new_kwargs)
    out = _by_runs(func, new_args, new_kwargs)
    # New tensors (e.g. AdamW's sqrt of its second moment) are laid out like the first
    # argument's: Pieces where those are, so that the ops the optimizer runs on them next
    # take this path too, not DTensor's (which re-checks every spec at each op).
    return [like(t, o, r) for t, o, r in zip(first, out, refs)]


def contiguous_runs(ts: list[torch.Tensor]) -> list[int]:
    """Lengths of the runs of consecutive 1-D contiguous tensors in ``ts`` that lie back to
    back in one storage (the pieces of a group's flat buffer), front to back."""
    lengths: list[int] = []
    end = None  # (storage pointer, dtype, offset) where the previous tensor ended
    for t in ts:
        flat = t.dim() == 1 and t.stride(0) == 1
        here = (t.untyped_storage().data_ptr(), t.dtype, t.storage_offset())
        if flat and here[0] and end == here:  # a null pointer: meta tensors
            lengths[-1] += 1
        else:
            lengths.append(1)
        end = (here[0], here[1], here[2] + t.numel()) if flat else None
    return lengths


def _by_runs(func, args: list, kwargs: dict) -> list[torch.Tensor] | torch.Tensor:
    """An out-of-place op on local tensors. A foreach op whose only tensor argument is its
    first list runs once over each run of back-to-back pieces (``contiguous_runs``), the results
    being views of one new tensor per run: one allocation of the group's size instead of
    one odd-sized allocation per piece (each of which the caching allocator rounds), as
    for the packed optimizer state; same values, element by element."""
    ts = args[0]
    if not (isinstance(ts, list) and func.__name__.startswith("_foreach_") and not kwargs
            and not any(isinstance(a, (torch.Tensor, list, tuple)) for a in args[1:])):
        return func(*args, **kwargs)
    lengths = contiguous_runs(ts)
    if len(lengths) == len(ts):
        return func(*args, **kwargs)
    spans, i = [], 0
    for n in lengths:
        first = ts[i]
        numel = sum(t.numel() for t in ts[i:i + n])
        spans.append(first if n == 1 else first.as_strided((numel,), (1,),
                                                           first.storage_offset()))
        i += n
    out, i = [], 0
    for n, res in zip(lengths, func(spans, *args[1:])):
        out += [res] if n == 1 else list(res.split([t.numel() for t in ts[i:i + n]]))
        i += n
    return out
