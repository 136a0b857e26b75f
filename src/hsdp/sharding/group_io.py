"""A parameter group's state I/O: optimizer-state packing and loading whole flat buffers
(each parameter's piece for state dicts: ``GroupBuffers``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hsdp.sharding.group_buffers import GroupBuffers
from hsdp.sharding.pieces import Piece, piece_like
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



class GroupIO:
    """Optimizer-state packing and loading of one group's buffers."""

    def __init__(self, buffers: GroupBuffers) -> None:
        self.b = buffers

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
        held = [(q.sharded, q.offset, q.length) for q in self.b.params if q.length]
        empty = [(p, j, 1) for j, p in enumerate(
            q.sharded for q in self.b.params if not q.length)]
        for pieces, numel in ((held, self.b.main.numel()), (empty, len(empty))):
            states = [state.get(p) for p, _, _ in pieces]
            if pieces and all(st is not None for st in states):
                for key in set.intersection(*(set(st) for st in states)):
                    _pack(states, key, pieces, numel)

    def load_flat(self, flat: torch.Tensor) -> None:
        """Take this rank's shards from ``flat``, the whole group in the original dtype
        (identical on every rank; no communication); float8 weights: their scales too,
        from the whole weights."""
        lo, hi = self.b.layout.owned_range(self.b.comms.outer_rank, self.b.comms.inner_rank)
        before_write([q.sharded for q in self.b.params])
        self.b.main.copy_(flat[lo:hi])
        if self.b.float8 is not None:
            self.b.float8.set_amax(torch.stack([
                flat[a:a + n].abs().max().float()
                for a, n in zip(self.b.layout.offsets, self.b.layout.numels)]))
        if self.b.shard_outer:
            a, b = self.b.inner_lo, self.b.inner_lo + self.b.layout.shard_numel
            if self.b.float8 is None:
                self.b.inner_shard.copy_(flat[a:b])
            else:
                self.b.float8.cast(self.b.inner_shard, flat[a:b], self.b.layout.pieces(a, b))
        if self.b.float8 is not None:
            self.b.float8.scaled_at(self.b.version())
