"""hfsdp's compressed outer parameter all-gather, the ``outer_gather`` mode
(``fully_shard(..., outer_gather=hsdp.OuterGather(...))``; ``topology/outer_mode.py``):
its settings, its refusals and its codec on each group (``compressed_gather.py``), which
the group's all-gathers use (``group_gather.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch.nn as nn

from hsdp.sharding.compressed_gather import CompressedGather
from hsdp.sharding.float8_weights import float8_dtype
from hsdp.sharding.group import ParamGroup
from hsdp.sharding.policy import Strategy, check_format, parse_format
from hsdp.streams.op_table import OpKind
from hsdp.topology.outer_mode import OuterMode


@dataclass(frozen=True)
class OuterGather(OuterMode):
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

    argument: ClassVar[str] = "outer_gather"
    forms: ClassVar[str] = "DTYPE[:BLOCK]"

    def __post_init__(self) -> None:
        check_format("OuterGather", self.dtype, self.block)

    @classmethod
    def parse(cls, text: str) -> OuterGather:
        """"int8", "fp8_e4m3:128" (DTYPE[:BLOCK])."""
        return parse_format(text, "outer gather", cls)

    def check_shard(self, strategy: Strategy, comms: Any, device: Any,
                    params: list[nn.Parameter], names: list[str]) -> None:
        """Only hfsdp gathers parameters over outer; torchao float8 weights already cross
        the outer link as one byte per weight, cast with the scales their matmuls use
        (quantizing them again would round twice)."""
        if strategy is not Strategy.HFSDP:
            raise ValueError(
                f"fully_shard: outer_gather needs strategy='hfsdp': with strategy="
                f"'{strategy.value}' the weights are replicated over outer and updated on "
                f"every rank, there is no outer all-gather of parameters to compress "
                f"(outer_reduce compresses the outer gradient reduction)")
        f8 = [n for p, n in zip(params, names) if float8_dtype(p) is not None]
        if f8:
            raise ValueError(
                f"fully_shard: outer_gather on a unit with float8 weights ({', '.join(f8[:3])}"
                f"{', ...' if len(f8) > 3 else ''}): their float8 all-gather already moves "
                f"one byte per weight over outer. Pass outer_gather only to units without "
                f"float8 weights (e.g. the root holding embedding and output head), or leave "
                f"float8 all-gather off (enable_fsdp_float8_all_gather=False)")

    def attach(self, group: ParamGroup) -> None:
        """The codec of a group sharded over more than one outer rank (else: exact)."""
        c = group.comms
        if group.shard_outer and c.outer_size > 1:
            group.compressed_gather = CompressedGather(self, group.layout.shard_numel,
                                                       c.outer_size)


    def gather_op(self) -> OpKind:
        return OpKind.OUTER_Q_ALL_GATHER
