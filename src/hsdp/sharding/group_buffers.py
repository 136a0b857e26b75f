"""``GroupBuffers``: a parameter group's flat layout, buffers and parameters (one
``GroupParam`` each), as its parts (gathers, gradient state, state I/O) receive them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hsdp.sharding.float8_weights import Float8Weights
from hsdp.sharding.group_param import GroupParam
from hsdp.sharding.layout import FlatLayout
from hsdp.sharding.tp_blocks import block_of
from hsdp.topology.communicators import CommGroups


@dataclass(eq=False)
class GroupBuffers:
    """The tensors and parameters of one group, their only holder (``group_build.py``
    makes them; ``group.py`` describes each buffer)."""

    label: str
    comms: CommGroups
    layout: FlatLayout
    orig_dtype: torch.dtype
    reduce_dtype: torch.dtype
    shard_outer: bool  # the flat buffer is sharded over outer too (hfsdp, trainable)
    float8: Float8Weights | None
    inner_lo: int  # first element of this rank's inner shard
    main: torch.Tensor  # [C] original dtype: what the optimizer updates
    ag_src: torch.Tensor  # [S]: the inner all-gather's input
    inner_shard: torch.Tensor | None = None  # hfsdp [S]: refreshed by the outer all-gather
    chunk_offset: int = 0  # hfsdp: where ``main``'s chunk starts in the inner shard
    gathered: torch.Tensor | None = None  # [N]: allocated by the all-gather, freed by reshard
    gathered_bytes: int = 0
    params: list[GroupParam] = field(default_factory=list)  # (none before the views)

    def version(self) -> int:
        """Changes when the sharded values were written through ``main`` (checkpoint
        loading) or by a non-foreach in-place op on a DTensor parameter (which bumps the
        parameter's own counter). Foreach ops on DTensors bump nothing: the optimizer
        step hook marks the group written instead."""
        return self.main._version + sum(q.sharded._version for q in self.params)

    def check_float8_scales(self) -> None:
        """Refuse to gather float8 weights whose values changed since their scales were
        computed (a load, an edit by hand): the cast would saturate or lose precision."""
        if self.float8 is not None and self.float8.version != self.version():
            raise RuntimeError(
                f"hsdp: the float8 weights of group {self.label} changed since their scales "
                f"were computed (hsdp computes them after each optimizer.step()); call "
                f"hsdp.precompute_float8_scales(model) after changing weights another way "
                f"(loading a checkpoint, editing them), before the next forward")

    def whole(self, flat: torch.Tensor, idx: int) -> torch.Tensor:
        """Parameter ``idx`` whole, from ``full_flat``'s result: a collective over the tp
        group where TP shards it (every rank must call it)."""
        off, n = self.layout.offsets[idx], self.layout.numels[idx]
        t = flat[off:off + n].view(self.layout.shapes[idx])
        block = block_of(self.params[idx].spec)
        return t if block is None else block.whole(t, self.comms.host_tp)
