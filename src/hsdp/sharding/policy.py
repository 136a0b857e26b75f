"""User-facing policies (pure): strategy, mixed precision, the one-byte formats of the
compressed outer modes (``outer_reduce.py``, ``outer_gather.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch


class Strategy(str, Enum):
    """How a unit's state lies on the outer axis. ``HSDP``: parameters, gradients and
    optimizer state sharded over inner, replicated over outer (gradients: inner
    reduce-scatter, outer all-reduce). ``HFSDP``: gradients and optimizer state sharded
    over outer too (outer reduce-scatter, then an outer all-gather of the updated
    weights). Equal to its string value, so ``"hfsdp"`` is accepted wherever a
    ``Strategy`` is."""

    HSDP = "hsdp"
    HFSDP = "hfsdp"

    @classmethod
    def parse(cls, value: Strategy | str) -> Strategy:
        """``value`` as a ``Strategy``; ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown strategy {value!r}; expected one of "
                             f"{[s.value for s in cls]}") from None

    @property
    def shards_outer(self) -> bool:
        """Whether trainable state is sharded over the outer axis too."""
        return self is Strategy.HFSDP


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: dtype of the gathered parameters used by compute.
    ``reduce_dtype``: dtype of the gradient reduce-scatter / all-reduce (default: param_dtype).
    ``output_dtype``: the unit's floating-point outputs are cast to it (default: as computed).
    ``cast_forward_inputs``: the unit's floating-point inputs are cast to ``param_dtype``
    (as FSDP2's ``MixedPrecisionPolicy``, on by default).
    Main weights, gradients handed to the optimizer and optimizer state keep the
    parameters' original dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @property
    def input_dtype(self) -> torch.dtype | None:
        """What the unit's floating-point inputs are cast to (None: left as they are)."""
        return self.param_dtype if self.cast_forward_inputs else None

    def resolve(self, orig: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(param_dtype, reduce_dtype) for a group whose parameters are ``orig``."""
        if not orig.is_floating_point:
            return orig, orig
        param = self.param_dtype or orig
        return param, self.reduce_dtype or param


OUTER_DTYPES = ("int8", "fp8_e4m3")  # the one-byte formats of the compressed outer modes


def check_format(owner: str, dtype: object, block: object) -> None:
    """``hsdp.<owner>``'s one-byte format and block size, or a ValueError."""
    if dtype not in OUTER_DTYPES:
        raise ValueError(f"hsdp.{owner}: unknown dtype {dtype!r}; expected one "
                         f"of {OUTER_DTYPES}")
    if (not isinstance(block, int) or isinstance(block, bool) or block < 16
            or block > 65536 or block & (block - 1)):
        raise ValueError(f"hsdp.{owner}: block={block!r} does not divide the outer "
                         f"chunks into whole blocks; use a power of two from 16 to 65536")


def parse_format(text: str, what: str, make: Callable[..., object]) -> object:
    """``make(dtype[, block])`` from a compressed mode's short form "DTYPE[:BLOCK]"."""
    dtype, _, block = text.partition(":")
    if block and not block.isdigit():
        raise ValueError(f"bad {what} {text!r}: expected none or DTYPE[:BLOCK]")
    return make(dtype, int(block)) if block else make(dtype)


def as_mixed_precision(mp_policy: object) -> MixedPrecision:
    """``fully_shard``'s ``mp_policy``: an ``hsdp.MixedPrecision``, torch FSDP2's
    ``MixedPrecisionPolicy`` (the same four fields, same meaning) or None (no casts)."""
    if mp_policy is None:
        return MixedPrecision()
    if isinstance(mp_policy, MixedPrecision):
        return mp_policy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(mp_policy, MixedPrecisionPolicy):
        return MixedPrecision(mp_policy.param_dtype, mp_policy.reduce_dtype,
                              mp_policy.output_dtype, mp_policy.cast_forward_inputs)
    hint = (f"; for {mp_policy} compute use hsdp.MixedPrecision(param_dtype={mp_policy}) "
            f"(reduce_dtype defaults to param_dtype)"
            if isinstance(mp_policy, torch.dtype) else "")
    raise TypeError(f"fully_shard: mp_policy must be an hsdp.MixedPrecision, torch's "
                    f"MixedPrecisionPolicy or None, got {mp_policy!r}{hint}")


def check_reshard_after_forward(value: object) -> bool:
    """``reshard_after_forward`` as a bool: True / False, or FSDP2's None (its default:
    reshard every unit but the root, which is what True does in hsdp). FSDP2's int (reshard
    to a smaller world) is refused: hsdp's inner group already is that world."""
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        raise ValueError(
            f"hsdp: reshard_after_forward={value} (FSDP2: keep a copy resharded over "
            f"{value} ranks between forward and backward) is not supported: hsdp shards "
            f"parameters over its inner (intra-node) group only, so True already regathers "
            f"from node-local shards; use True, or False to keep the unit gathered")
    raise TypeError(f"hsdp: reshard_after_forward must be a bool, got {value!r}")
