"""``GroupBuffers``: a parameter group's flat layout, buffers and parameters, as its parts
(gathers, gradient state, state I/O) receive them; ``group.py`` builds them and
describes each buffer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from hsdp.sharding.float8_weights import Float8Weights
from hsdp.sharding.layout import FlatLayout
from hsdp.sharding.pieces import checkpoint_view
from hsdp.sharding.tp_blocks import block_of
from hsdp.topology.communicators import CommGroups


@dataclass(eq=False)
class GroupBuffers:
    """The tensors and parameters of one group (the same objects as ``ParamGroup``'s)."""

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
    inner_shard: torch.Tensor | None  # hfsdp [S]: refreshed by the outer all-gather
    chunk_offset: int  # hfsdp: where ``main``'s chunk starts in the inner shard
    gathered: torch.Tensor  # [N]: storage allocated by the all-gather, freed by reshard
    gathered_bytes: int
    sharded: list[nn.Parameter]  # DTensors over views of ``main``
    unsharded: list[nn.Parameter]  # views of ``gathered``
    slots: list[list[tuple[nn.Module, str]]]  # where modules show each parameter
    slices: list[tuple[int, int]]  # (offset in main, length) per parameter
    shard_starts: list[int]  # first element of each parameter held here
    specs: list  # each sharded parameter's DTensor spec
    tp_specs: list  # each gathered parameter's spec on mesh["tp"] (None: plain)
    guard_hooks: list[int | None]  # hsdp's own grad hook on each sharded parameter

    def version(self) -> int:
        """Changes when the sharded values were written through ``main`` (checkpoint
        loading) or by a non-foreach in-place op on a DTensor parameter (which bumps the
        parameter's own counter). Foreach ops on DTensors bump nothing: the optimizer
        step hook marks the group written instead."""
        return self.main._version + sum(p._version for p in self.sharded)

    def check_float8_scales(self) -> None:
        """Refuse to gather float8 weights whose values changed since their scales were
        computed (a load, an edit by hand): the cast would saturate or lose precision."""
        if self.float8 is not None and self.float8.version != self.version():
            raise RuntimeError(
                f"hsdp: the float8 weights of group {self.label} changed since their scales "
                f"were computed (hsdp computes them after each optimizer.step()); call "
                f"hsdp.precompute_float8_scales(model) after changing weights another way "
                f"(loading a checkpoint, editing them), before the next forward")

    def float8_pieces(self) -> list[torch.Tensor]:
        """This rank's piece of each float8 weight (what its scale is computed from)."""
        return [self.main[a:a + n] for a, n in self.slices]

    def local(self, idx: int) -> torch.Tensor:
        """This rank's piece of parameter ``idx``: a 1-D view of ``main`` (writes into it
        bump ``main``'s version counter, which ``version`` watches)."""
        a, n = self.slices[idx]
        return self.main[a:a + n]

    def piece_of(self, idx: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of parameter ``idx`` in ``full``, the whole parameter (of
        the global shape: its TP block first, where TP shards it)."""
        block = block_of(self.specs[idx])
        flat = (full if block is None else block.local_of(full)).reshape(-1)
        start = self.shard_starts[idx]
        return flat[start:start + self.slices[idx][1]]

    def whole(self, flat: torch.Tensor, idx: int) -> torch.Tensor:
        """Parameter ``idx`` whole, from ``full_flat``'s result: a collective over the tp
        group where TP shards it (every rank must call it)."""
        off, n = self.layout.offsets[idx], self.layout.numels[idx]
        t = flat[off:off + n].view(self.layout.shapes[idx])
        block = block_of(self.specs[idx])
        return t if block is None else block.whole(t, self.comms.host_tp)

    def checkpoint_view(self, idx: int, local: torch.Tensor | None = None) -> torch.Tensor:
        """A DTensor for state dicts over ``local`` (by default parameter ``idx``'s piece),
        which must be laid out like that piece (e.g. its optimizer state)."""
        return checkpoint_view(self.sharded[idx], self.local(idx) if local is None else local)
