"""A parameter group's gathers: HOW one group is all-gathered (inner, and hfsdp's outer
all-gather) and freed (``runtime/gather.py`` decides WHEN, on which stream); its
reductions are its gradient state's (``group_grads.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hsdp.sharding.comm import Collectives
from hsdp.sharding.compressed_gather import CompressedGather
from hsdp.sharding.float8_weights import as_bytes
from hsdp.sharding.group_buffers import GroupBuffers
from hsdp.streams.contract import Event, SideStream
from hsdp.streams.op_table import OpKind, label


class GroupGather:
    """A group's all-gathers and the events they leave: whether and when its parameters
    are gathered, and (hfsdp) the version of ``main`` its inner shard was gathered from."""

    def __init__(self, buffers: GroupBuffers,
                 compressed: CompressedGather | None = None) -> None:
        self.b = buffers
        self.compressed = compressed  # hfsdp's compressed outer all-gather (None: exact)
        self.gathered_event: Event | None = None  # None: not gathered
        self.params_ready: Event | None = None  # hfsdp: last outer all-gather
        self.synced_version: int | None = None
        self.mark_synced()

    @property
    def outer_kind(self) -> OpKind:
        """hfsdp's outer all-gather, compressed with a codec."""
        return OpKind.OUTER_ALL_GATHER if self.compressed is None else self.compressed.op_kind()

    def mark_written(self) -> None:
        """hfsdp: the next refresh re-gathers the inner shard from every updated chunk."""
        self.synced_version = None

    def mark_synced(self) -> None:
        """The inner shard holds ``main``'s current values (built from them, or a load
        wrote both). Not with a compressed outer all-gather: the gathered weights are the
        dequantized chunks, always, so the next forward gathers them first."""
        self.synced_version = None if self.compressed is not None else self.b.version()

    def unshard(self, stream: SideStream, coll: Collectives, after: Sequence[Event]) -> Event:
        """Allocate the gathered buffer on ``stream`` and inner all-gather into it."""
        b = self.b
        b.check_float8_scales()
        cast = b.float8 is not None and b.ag_src.dtype != b.gathered.dtype

        def run() -> None:
            b.gathered.untyped_storage().resize_(b.gathered_bytes)
            lo, hi = b.inner_lo, b.inner_lo + b.layout.shard_numel
            chunk = b.gathered[lo:hi]
            if cast:  # hsdp float8: this rank's pieces of the weights, cast with their scales
                b.float8.cast(chunk, b.ag_src, b.layout.pieces(lo, hi))
            else:
                chunk.copy_(b.ag_src)  # cast to param dtype where it differs
            coll.all_gather(as_bytes(b.gathered), as_bytes(chunk), b.comms.inner_ag, "inner")
        self.gathered_event = stream.submit(run, after, label(OpKind.GATHER, b.label))
        return self.gathered_event

    def reshard(self, stream: SideStream, after: Sequence[Event]) -> Event:
        """Free the gathered buffer on the stream that allocated it."""
        self.gathered_event = None
        gathered = self.b.gathered
        return stream.submit(lambda: gathered.untyped_storage().resize_(0), after,
                             label(OpKind.FREE_GATHERED, self.b.label))

    def outer_all_gather(self, stream: SideStream, coll: Collectives,
                         after: Sequence[Event]) -> Event:
        """hfsdp: rebuild the inner shard from every outer rank's updated ``main`` chunk
        (float8 weights: their float8 bytes, cast with their scales; a codec:
        quantized, ``compressed_gather.py``)."""
        b = self.b
        b.check_float8_scales()

        def run() -> None:
            if self.compressed is not None:
                self.compressed.all_gather(coll, b.inner_shard, b.main, b.comms.outer)
                return
            lo, n = b.chunk_offset, b.main.numel()
            chunk = b.inner_shard[lo:lo + n]
            if b.float8 is not None:
                start = b.inner_lo + lo
                b.float8.cast(chunk, b.main, b.layout.pieces(start, start + n))
            elif chunk.data_ptr() != b.main.data_ptr():
                chunk.copy_(b.main)  # cast to param dtype
            coll.all_gather(as_bytes(b.inner_shard), as_bytes(chunk), b.comms.outer, "outer")
        self.synced_version = b.version()
        self.params_ready = stream.submit(run, after, label(self.outer_kind, b.label))
        return self.params_ready

    def full_flat(self, coll: Collectives) -> torch.Tensor:
        """The whole flat buffer in the original dtype (host-side collectives on compute)."""
        b = self.b
        shard = b.main
        if b.shard_outer:
            shard = torch.empty(b.layout.shard_numel, dtype=b.orig_dtype, device=b.main.device)
            coll.all_gather(shard, b.main, b.comms.host_outer, "outer")
        full = torch.empty(b.layout.total, dtype=b.orig_dtype, device=b.main.device)
        coll.all_gather(full, shard, b.comms.host_inner, "inner")
        return full
