"""A parameter group's state I/O: pieces for state dicts, optimizer-state packing and
loading whole flat buffers."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hsdp.sharding.pieces import Piece, checkpoint_view, piece_like
from hsdp.sharding.tp_blocks import block_of
from hsdp.sharding.write_guard import before_write


def _pack(states: list[dict], key: str, pieces: list[tuple[Piece, int, int]],
          numel: int) -> None:
    """``pack_state`` for one key: each state ``states[i][key]`` (of ``pieces[i]``: the
    parameter, its offset and length) becomes the view at that offset of one new buffer
    of ``numel`` elements, unless it is already there or is not an elementwise Piece."""
    values = [st[key] for st in states]
    if not all(isinstance(v, Piece) and v._local_tensor.numel() == n
               and v.dtype == values[0].dtype for v, (_, _, n) in zip(values, pieces)):
        return
    locals_ = [v._local_tensor for v in values]
    base = locals_[0].untyped_storage()
    if base.nbytes() == numel * locals_[0].element_size() and all(
            t.untyped_storage().data_ptr() == base.data_ptr() and t.storage_offset() == a
            for t, (_, a, _) in zip(locals_, pieces)):
        return  # packed already
    flat = torch.zeros(numel, dtype=values[0].dtype, device=locals_[0].device)
    views = [flat[a:a + n] for _, a, n in pieces]
    torch._foreach_copy_(views, locals_)
    for st, (p, _, _), view in zip(states, pieces, views):
        st[key] = piece_like(p, view)



class GroupState:
    """Checkpoint and optimizer-state I/O of ``ParamGroup`` (a mixin)."""

    def local(self, idx: int) -> torch.Tensor:
        """This rank's piece of parameter ``idx``: a 1-D view of ``main`` (writes into it
        bump ``main``'s version counter, which ``version`` watches)."""
        a, n = self._slices[idx]
        return self.main[a:a + n]

    def piece_of(self, idx: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of parameter ``idx`` in ``full``, the whole parameter (of
        the global shape: its TP block first, where TP shards it)."""
        block = block_of(self.specs[idx])
        flat = (full if block is None else block.local_of(full)).reshape(-1)
        start = self.shard_starts[idx]
        return flat[start:start + self._slices[idx][1]]

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

    def pack_state(self, state: Mapping[torch.Tensor, dict]) -> None:
        """Move the optimizer's elementwise state of this group's parameters (``state``:
        ``optimizer.state``, values already Pieces) into one flat buffer per state key,
        laid out like ``main``: each value becomes the view at its parameter's offset (the
        empty pieces' one-element placeholders: back to back in a small buffer of their
        own). Why: the optimizer allocates one tensor per parameter, and hsdp's pieces are
        split where the flat shards end, not at rows, so their odd sizes each cost the
        caching allocator's rounding (0.1-0.4 MB a model at 8B sizes, more than FSDP2's
        round row shards), and each placeholder a 512-byte block; one buffer per key is a
        single allocation. Only when every parameter of the pool has the key (otherwise
        the buffer would hold room for state that does not exist); values are copied
        exactly."""
        held = [(p, a, n) for p, (a, n) in zip(self.sharded, self._slices) if n]
        empty = [(p, j, 1) for j, p in enumerate(
            p for p, (_, n) in zip(self.sharded, self._slices) if not n)]
        for pieces, numel in ((held, self.main.numel()), (empty, len(empty))):
            states = [state.get(p) for p, _, _ in pieces]
            if pieces and all(st is not None for st in states):
                for key in set.intersection(*(set(st) for st in states)):
                    _pack(states, key, pieces, numel)

    def load_flat(self, flat: torch.Tensor) -> None:
        """Take this rank's shards from ``flat``, the whole group in the original dtype
        (identical on every rank; no communication); float8 weights: their scales too,
        from the whole weights."""
        lo, hi = self.layout.owned_range(self.comms.outer_rank, self.comms.inner_rank)
        before_write(self.sharded)
        self.main.copy_(flat[lo:hi])
        if self.float8 is not None:
            self.float8.set_amax(torch.stack([
                flat[a:a + n].abs().max().float()
                for a, n in zip(self.layout.offsets, self.layout.numels)]))
        if self.shard_outer:
            a, b = self.inner_lo, self.inner_lo + self.layout.shard_numel
            if self.float8 is None:
                self.inner_shard.copy_(flat[a:b])
            else:
                self.float8.cast(self.inner_shard, flat[a:b], self.layout.pieces(a, b))
        self.synced_version = self.version()  # the inner shard is up to date
        if self.float8 is not None:
            self.float8.version = self.synced_version
