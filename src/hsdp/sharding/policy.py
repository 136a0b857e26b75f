"""User-facing policies (pure)."""

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


OUTER_DTYPES = ("int8", "fp8_e4m3")


def _check_format(owner: str, dtype: object, block: object) -> None:
    """``hsdp.<owner>``'s one-byte format and block size, or a ValueError."""
    if dtype not in OUTER_DTYPES:
        raise ValueError(f"hsdp.{owner}: unknown dtype {dtype!r}; expected one "
                         f"of {OUTER_DTYPES}")
    if (not isinstance(block, int) or isinstance(block, bool) or block < 16
            or block > 65536 or block & (block - 1)):
        raise ValueError(f"hsdp.{owner}: block={block!r} does not divide the outer "
                         f"chunks into whole blocks; use a power of two from 16 to 65536")


@dataclass(frozen=True)
class OuterReduce:
    """Compressed outer gradient reduction (``fully_shard(..., outer_reduce=...)``).

    ``dtype``: what crosses the outer link, "int8" or "fp8_e4m3" (one byte per element).
    ``block``: elements per quantization block, each with an fp32 scale (4 bytes per
    block: 1.6 % at the default 256); a power of two from 16 to 65536, so that blocks
    tile each outer chunk (padded to whole blocks).
    ``error_feedback``: each rank adds what quantization dropped last step to its next
    gradient before quantizing (training state: checkpoints carry it).
    The reduced gradient's sum is taken in fp32 (docs/guide/slow_outer_links.md)."""

    dtype: str = "int8"
    block: int = 256
    error_feedback: bool = True

    def __post_init__(self) -> None:
        _check_format("OuterReduce", self.dtype, self.block)
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"hsdp.OuterReduce: error_feedback must be a bool, got "
                            f"{self.error_feedback!r}")


def _parse_short(text: str, what: str, make: type) -> object | None:
    """``make(dtype[, block])`` from "DTYPE[:BLOCK]"; None for "none"."""
    if text == "none":
        return None
    dtype, _, block = text.partition(":")
    if block and not block.isdigit():
        raise ValueError(f"bad {what} {text!r}: expected none or DTYPE[:BLOCK]")
    return make(dtype, int(block)) if block else make(dtype)


def parse_outer_reduce(text: str) -> OuterReduce | None:
    """A command line's outer reduction: "none", "int8", "fp8_e4m3:128" (DTYPE[:BLOCK])."""
    return _parse_short(text, "outer reduction", OuterReduce)


def as_outer_reduce(value: object) -> OuterReduce | None:
    """``fully_shard``'s ``outer_reduce``: an ``OuterReduce``, None (exact reduction), or
    its short form "DTYPE[:BLOCK]" ("int8", "fp8_e4m3:128"; "none": None)."""
    return _as_format(value, "outer_reduce", OuterReduce, parse_outer_reduce)


@dataclass(frozen=True)
class OuterGather:
    """Compressed outer parameter all-gather of ``strategy="hfsdp"``
    (``fully_shard(..., outer_gather=...)``): after each optimizer step every rank sends
    its updated chunk of the weights quantized blockwise instead of in the parameter
    dtype. The fp32 main weights (what the optimizer updates and checkpoints save) stay
    exact; the gathered replicas are the dequantized chunks, the rank's own one too, so
    they are identical on every rank (docs/guide/slow_outer_links.md).

    ``dtype``: "int8" or "fp8_e4m3" (one byte per weight); ``block``: weights per
    quantization block, each with an fp32 scale, a power of two from 16 to 65536."""

    dtype: str = "int8"
    block: int = 256

    def __post_init__(self) -> None:
        _check_format("OuterGather", self.dtype, self.block)


def parse_outer_gather(text: str) -> OuterGather | None:
    """A command line's outer parameter all-gather: "none", "int8", "fp8_e4m3:128"."""
    return _parse_short(text, "outer gather", OuterGather)


def as_outer_gather(value: object) -> OuterGather | None:
    """``fully_shard``'s ``outer_gather``: an ``OuterGather``, None (the exact gather), or
    its short form "DTYPE[:BLOCK]"."""
    return _as_format(value, "outer_gather", OuterGather, parse_outer_gather)


def _as_format(value: object, arg: str, cls: type, parse: Callable[[str], object]) -> object:
    """``fully_shard``'s ``arg``: a ``cls``, None, or its short form parsed by ``parse``."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        return parse(value)
    raise TypeError(f"fully_shard: {arg} must be an hsdp.{cls.__name__}, its short form "
                    f"'DTYPE[:BLOCK]' (DTYPE in {OUTER_DTYPES}) or None, got {value!r}")


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
