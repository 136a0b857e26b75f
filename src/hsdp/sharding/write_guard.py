"""Write guards: a write into a parameter's storage waits for the background op that may
still read it (hfsdp's outer all-gather), and hsdp's own loops skip ``__torch_function__``."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

DATA = torch.Tensor.data  # ``p.data``'s getter is ``DATA.__get__``

# Groups of parameters whose storage a background op may still read or write (hfsdp's
# outer all-gather, issued by ``optimizer.step()``), each with the wait that orders a
# write after that op. Keys are the groups (``p._hsdp_group`` of their parameters, set
# by ``group.py``); values reference no group, so a dropped model is collected.
# Process-wide: writes to a parameter come through torch's dispatch, which knows no model.
PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()



def before_write(tensors: Sequence[torch.Tensor]) -> None:
    """Make the caller's next ops (compute) wait for the background op of every group in
    ``PENDING`` that one of ``tensors`` belongs to: a write into a parameter must not race
    with the all-gather reading (and, in place, writing) its storage."""
    for t in tensors:
        group = getattr(t, "_hsdp_group", None)
        wait = None if group is None else PENDING.pop(group, None)
        if wait is not None:
            wait()


def written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes into: the first argument of an in-place op (``mul_``,
    ``copy_``, ``_foreach_lerp_``, ``p += x``), ``out=``; ``p.data`` counts as a write
    (what is written through it bumps no version counter)."""
    name = getattr(func, "__name__", "")
    out = kwargs.get("out")
    first = args[0] if args else None
    inplace = (name.endswith("_") and not name.startswith("__")) or (
        name == "__get__" and getattr(func, "__self__", None) is DATA)
    written = ([] if not inplace else list(first) if isinstance(first, (list, tuple))
               else [first])
    if out is not None:
        written += list(out) if isinstance(out, (list, tuple)) else [out]
    return written


def direct() -> torch._C.DisableTorchFunctionSubclass:
    """A context in which hsdp's own loops read and set its Pieces' attributes (``.grad``,
    ``.requires_grad``) without the ``Piece.__torch_function__`` call each access makes
    (about 1.4 us; hundreds per step)."""
    return torch._C.DisableTorchFunctionSubclass()


def any_requires_grad(args: Sequence) -> bool:
    """Whether a tensor among ``args`` (or in a list there) requires grad."""
    with direct():
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    return True
    return False

