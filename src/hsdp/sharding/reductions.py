"""Reductions over every element of a ``Piece``, computed from the elements each rank
holds, and the ops refused on Pieces (their result depends on where elements lie)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

DECLINED = object()  # the op goes on as on any DTensor


# Reductions over every element, computed here on the pieces: torch's DTensor would reduce
# the local tensors as if they were ``torch.chunk`` rows, counting the placeholders of
# empty pieces (a max of negative values gave 0) and averaging uneven pieces as even ones
# (a mean gave half the value). name -> how the ranks' partial results combine.
_REDUCTIONS = {"sum": "sum", "nansum": "sum", "mean": "sum", "nanmean": "sum",
               "prod": "prod", "max": "max", "amax": "max", "min": "min", "amin": "min",
               "all": "min", "any": "max", "count_nonzero": "sum", "norm": "norm",
               "vector_norm": "norm"}


# Ops whose result depends on where each element lies, which a Piece does not tell
# DTensor: refused on every rank rather than computed from the wrong elements, raised on
# some ranks only, or (where DTensor redistributes) run on local tensors of different sizes
# on different ranks: a collective mismatch that aborts the process.
_REFUSED = ("std", "var", "std_mean", "var_mean", "median", "nanmedian", "mode", "quantile",
            "nanquantile", "kthvalue", "topk", "sort", "argsort", "msort", "argmax", "argmin",
            "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "logsumexp", "aminmax",
            "unique", "unique_consecutive", "histc", "bincount",
            # views, indexing, joins and linear algebra: the local tensor is not the rows
            # DTensor would index, join or multiply
            "__getitem__", "__setitem__", "view", "view_as", "reshape", "reshape_as",
            "flatten", "unflatten", "ravel", "squeeze", "unsqueeze", "t", "transpose",
            "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "expand", "expand_as",
            "broadcast_to", "repeat", "repeat_interleave", "tile", "narrow", "select",
            "index_select", "masked_select", "take", "take_along_dim", "gather", "scatter",
            "scatter_add", "index_add", "index_copy", "index_fill", "index_put",
            "masked_scatter", "split", "chunk", "unbind", "tensor_split", "hsplit", "vsplit",
            "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "matmul",
            "mm", "mv", "bmm", "dot", "vdot", "inner", "outer", "kron", "tensordot", "einsum",
            "__matmul__", "__rmatmul__", "softmax", "log_softmax", "roll", "flip", "fliplr",
            "flipud", "rot90", "tril", "triu", "diag", "diagonal", "trace", "nonzero",
            "argwhere", "unfold", "as_strided", "diff", "cross", "index_put_", "scatter_",
            "scatter_add_", "index_add_", "index_copy_", "index_fill_", "masked_scatter_",
            "put_", "tril_", "triu_", "squeeze_", "unsqueeze_", "t_", "transpose_")


def _functions(names) -> dict:
    """torch function and Tensor method objects of ``names`` -> name."""
    out = {}
    for n in names:
        for ns in (torch, torch.Tensor, torch.linalg):
            f = getattr(ns, n, None)
            if f is not None:
                out[f] = n
    return out


# One lookup per op on the hot path (most ops are none of these): func -> (kind, name).
SPECIAL = {**{f: ("reduce", n) for f, n in _functions(_REDUCTIONS).items()},
            **{f: ("refuse", n) for f, n in _functions(_REFUSED).items()},
            torch._foreach_norm: ("norms", "_foreach_norm")}


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# Where a shard met an op outside its unit's forward, a method other than forward may be
# the cause (FSDP2 users register it with torch's function, which ignores hsdp modules).
ENTRY_POINTS = (
    " If this runs in a method other than forward (generate, encode), register it: "
    "hsdp.register_forward_method(module, 'name') makes it gather and reshard as forward "
    "does (as torch's register_fsdp_forward_method does once hsdp has sharded a module; "
    "imported before that, torch's does nothing on hsdp modules).")

_MIXED = "mixed torch.Tensor and DTensor"


def note_mixed(exc: BaseException) -> None:
    """Say what DTensor's "mixed torch.Tensor and DTensor" error means on hsdp's shards,
    once per error."""
    if _MIXED in str(exc) and not any(ENTRY_POINTS in n for n in getattr(exc, "__notes__", ())):
        exc.add_note(
            "hsdp: outside its unit's forward a parameter is this rank's shard (a DTensor): "
            "it was probably used outside the forward of the unit that owns it. Use it "
            "inside that forward, or fully_shard the module that uses it together with it "
            "(their common parent)." + ENTRY_POINTS)


def _refuse(name: str) -> RuntimeError:
    return RuntimeError(
        f"hsdp: {name}() of a sharded parameter, gradient or optimizer state (or of a "
        f"tensor computed elementwise from one) is not supported: its local tensor is a "
        f"flat range of the tensor (a one-element placeholder where this rank holds none "
        f"of it), not torch.chunk rows, so torch's DTensor would compute it from the wrong "
        f"elements. Elementwise ops and reductions over all elements (sum, mean, max, min, "
        f"prod, norm, all, any, count_nonzero) are supported; for anything else use "
        f"t.full_tensor() (under torch.no_grad()), which gathers the whole tensor on every "
        f"rank, or use the parameter inside its unit's forward, where it is whole."
        + ENTRY_POINTS)


def _torch_fn(name: str):
    return torch.linalg.vector_norm if name == "vector_norm" else getattr(torch, name)


def _whole(name: str, rest: tuple, kwargs: dict) -> tuple[float, torch.dtype | None] | None:
    """``(norm order, dtype)`` when a call of reduction ``name`` (``rest``, ``kwargs``: its
    arguments after the tensor) reduces over every element into one value; None when it
    has another form (a ``dim``, ``keepdim``, ``out``; ``max(a, b)`` is not a reduction)."""
    norm = _REDUCTIONS[name] == "norm"
    names = ("p", "dim", "keepdim", "dtype") if norm else ("dim", "keepdim", "dtype")
    if len(rest) > len(names) or any(isinstance(a, torch.Tensor) for a in rest):
        return None
    call = dict(zip(names, rest))
    for k, v in kwargs.items():
        call["p" if k == "ord" else k] = v
    if isinstance(call.get("dim"), torch.dtype):  # sum(torch.float64): the dtype overload
        call["dtype"] = call.pop("dim")
    if (call.pop("dim", None) is not None or call.pop("keepdim", False)
            or call.pop("out", None) is not None or set(call) - {"p", "dtype"}):
        return None
    order = call.get("p", 2.0)
    return (2.0 if order in (None, "fro") else float(order)), call.get("dtype")


def _reduce(piece: DTensor, name: str, order: float, dtype: torch.dtype | None) -> DTensor:
    """Reduction ``name`` (a key of ``_REDUCTIONS``; ``order``: a norm's) over every element
    of ``piece``: each rank reduces the elements it holds, then the ranks that hold the
    tensor's elements combine (``Piece._hsdp_groups``). The result is a replicated DTensor,
    as torch's is once reduced."""
    if torch.is_grad_enabled() and piece.requires_grad:
        raise RuntimeError(
            f"hsdp: {name}() of a sharded parameter is not differentiable (its gradient "
            f"would miss hsdp's reduction). Call it under torch.no_grad() or on p.detach().")
    length = piece._hsdp_range[1]
    held = piece._local_tensor.reshape(-1)[:length]
    kw = {} if dtype is None else {"dtype": dtype}
    combine = _REDUCTIONS[name]
    if piece.numel() == 0 or (name in ("mean", "nanmean", "norm", "vector_norm") and not (
            held.is_floating_point() or held.is_complex()) and dtype is None):
        # torch's own result (or error: an integer mean or norm) on the whole, empty, tensor
        whole = (torch.linalg.vector_norm(held, order, **kw) if combine == "norm"
                 else _torch_fn(name)(held, **kw))
        return _replicated(whole, piece)
    if combine == "norm":
        magnitude = held.abs() if dtype is None else held.to(dtype).abs()
        if order in (float("inf"), float("-inf")):
            combine = "max" if order > 0 else "min"
            part = (magnitude.amax() if order > 0 else magnitude.amin()) if length else (
                _identity(magnitude, combine))
            return _replicated(_combine(part, combine, piece), piece)
        if order == 0:
            return _replicated(_combine((magnitude != 0).sum().to(magnitude.dtype), "sum",
                                        piece), piece)
        total = _combine(magnitude.pow(order).sum(), "sum", piece)
        return _replicated(total.pow(1.0 / order), piece)
    if name in ("mean", "nanmean"):
        total = _combine((torch.nansum if name == "nanmean" else torch.sum)(held, **kw), "sum",
                         piece)
        count = (piece.numel() if name == "mean"
                 else _combine((~held.isnan()).sum(), "sum", piece))
        return _replicated(total / count, piece)
    if combine in ("max", "min") and name not in ("all", "any"):
        part = _torch_fn(name)(held) if length else _identity(held, combine)
    else:
        part = _torch_fn(name)(held, **kw)
    total = _combine(part, combine, piece)
    return _replicated(total.bool() if part.dtype == torch.bool else total, piece)


def special(piece_type: type, special: tuple[str, str], args: tuple, kwargs: dict):
    """An op of ``SPECIAL``: on a Piece, a reduction computed here (its result) or an op
    refused; ``_foreach_norm``'s placeholders zeroed. ``DECLINED``: the op goes on as
    usual."""
    kind, name = special
    first = args[0] if args else None
    if kind == "refuse" and isinstance(first, (list, tuple)) and any(
            isinstance(t, piece_type) for t in first):  # cat([p, q]), stack(...)
        raise _refuse(name)
    if kind == "norms" and isinstance(first, (list, tuple)):
        # DTensor's norms count every local element: the placeholders must be zero
        # (clip_grad_norm_), whatever in-place ops wrote into them.
        empty = [t._local_tensor for t in first
                 if isinstance(t, piece_type) and not t._hsdp_range[1]]
        if empty:
            with torch.no_grad():
                torch._foreach_zero_(empty)
    if not isinstance(first, piece_type) or kind == "norms":
        return DECLINED
    if kind == "refuse":
        raise _refuse(name)
    whole = _whole(name, args[1:], kwargs)
    if whole is not None:
        return _reduce(first, name, *whole)
    if any(isinstance(a, torch.Tensor) for a in args[1:]):  # max(a, b): elementwise
        return DECLINED
    raise _refuse(f"{name}(dim=...)")


def _identity(like: torch.Tensor, combine: str) -> torch.Tensor:
    """The value a rank that holds no element contributes to a max / min."""
    if like.is_floating_point():
        value = float("-inf") if combine == "max" else float("inf")
    elif like.dtype == torch.bool:
        value = combine == "min"
    else:
        info = torch.iinfo(like.dtype)
        value = info.min if combine == "max" else info.max
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _combine(part: torch.Tensor, combine: str, piece: DTensor) -> torch.Tensor:
    """``part`` combined over the ranks that hold ``piece``'s elements."""
    wire = part.to(torch.int32) if part.dtype == torch.bool else part  # a new tensor
    for group in piece._hsdp_groups:
        dist.all_reduce(wire, op=_REDUCE_OPS[combine], group=group)
    return wire


def _replicated(total: torch.Tensor, piece: DTensor) -> DTensor:
    mesh = piece.device_mesh
    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)

