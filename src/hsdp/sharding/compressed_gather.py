"""HFSDP's compressed outer parameter all-gather (the codec of ``outer_gather.py``; the
op table's ``OUTER_QAG``: the outer stream and communicator, where the exact ``OUTER_AG``
runs).

The inner shard (``S`` elements) is ``n`` outer chunks of ``C = S / n`` (``layout.py``);
outer rank ``o`` holds the exact chunk ``o`` in the original dtype (``main``: what the
optimizer updates). After an optimizer step each rank quantizes its chunk blockwise
(``quant.py``: one row of ``C`` elements padded to whole blocks), one all-gather brings
every rank every packed row, and every rank writes the dequantized rows into its inner
shard, cast to the parameter dtype: its own row too, dequantized from the bytes it sent.
So the inner shards, and the weights the inner all-gather builds from them, are the same
bit for bit on every rank of an outer group (every rank runs the same dequantization on
the same bytes). Its passes are ``quant.encode`` (one row) and ``quant.decode_into``: the
fused kernels on CUDA, the eager ops elsewhere. Nothing is kept between gathers, so a CUDA
graph records it as it runs.

``main`` is never written here: the optimizer keeps stepping the exact weights, and each
gather quantizes them afresh, so a quantization error lives for one step and does not
accumulate: there is no error-feedback residual, unlike the compressed reduction (whose
dropped gradient bits would otherwise be lost for good).

Bytes per rank on the outer link: ``(n-1)/n * S * (1 + 4/block)``; bf16's all-gather:
``2 (n-1)/n * S``. Transient memory: the packed rows (about ``S`` bytes) and their fp32
dequantization (``4 S`` bytes), per group while its gather runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hsdp.sharding.comm import Collectives
from hsdp.sharding.quant import Rows, decode_into, encode
from hsdp.streams.op_table import OpKind

if TYPE_CHECKING:
    from hsdp.sharding.outer_gather import OuterGather


class CompressedGather:
    """The compressed outer all-gather of a group's ``numel``-element inner shard over
    ``n`` outer ranks (stateless between steps)."""

    def __init__(self, config: OuterGather, numel: int, n: int) -> None:
        self.config = config
        self.rows = Rows(numel, n, config.block)
        self.mine = Rows(self.rows.c, 1, config.block)  # this rank's chunk: one row

    def op_kind(self) -> OpKind:
        """The ``OpKind`` its mode issues for the gather (``OuterMode.gather_op``)."""
        return self.config.gather_op()

    def all_gather(self, coll: Collectives, inner_shard: torch.Tensor, main: torch.Tensor,
                   group: dist.ProcessGroup) -> None:
        """``inner_shard`` (``S`` elements, any float dtype) = the dequantized chunks
        ``main`` (``C = S / n`` elements) of every outer rank, in outer rank order."""
        rows, fmt = self.rows, self.config.dtype
        packed, _ = encode(main.reshape(-1), self.mine, fmt)
        gathered = torch.empty(rows.n, rows.packed, dtype=torch.uint8, device=main.device)
        coll.all_gather(gathered.view(-1), packed.view(-1), group, "outer")
        decode_into(inner_shard, gathered, rows, fmt)
