"""A parameter group's collectives and the gradient copy-in: HOW one group is gathered,
reduced and freed (``runtime/schedule.py`` decides WHEN, on which stream)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hsdp.sharding.comm import Collectives
from hsdp.sharding.float8_weights import as_bytes
from hsdp.sharding.tp_blocks import grad_local
from hsdp.streams.contract import Event, SideStream
from hsdp.streams.op_table import OpKind, label


def _allocate(t: torch.Tensor) -> None:
    """Give ``t`` back its storage (on the current stream) if it was freed."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() < nbytes:
        t.untyped_storage().resize_(nbytes)



class GroupCollectives:
    """The collectives of ``ParamGroup`` (a mixin: the buffers are the group's)."""

    def unshard(self, stream: SideStream, coll: Collectives, after: Sequence[Event]) -> Event:
        """Allocate the gathered buffer on ``stream`` and inner all-gather into it."""
        self.check_float8_scales()
        cast = self.float8 is not None and self.ag_src.dtype != self.gathered.dtype

        def run() -> None:
            self.gathered.untyped_storage().resize_(self._gathered_bytes)
            lo, hi = self.inner_lo, self.inner_lo + self.layout.shard_numel
            chunk = self.gathered[lo:hi]
            if cast:  # hsdp float8: this rank's pieces of the weights, cast with their scales
                self.float8.cast(chunk, self.ag_src, self.layout.pieces(lo, hi))
            else:
                chunk.copy_(self.ag_src)  # cast to param dtype where it differs
            coll.all_gather(as_bytes(self.gathered), as_bytes(chunk), self.comms.inner_ag,
                            "inner")
        self.gathered_event = stream.submit(run, after, label(OpKind.GATHER, self.label))
        return self.gathered_event

    def reshard(self, stream: SideStream, after: Sequence[Event]) -> Event:
        """Free the gathered buffer on the stream that allocated it."""
        self.gathered_event = None
        return stream.submit(lambda: self.gathered.untyped_storage().resize_(0), after,
                             label(OpKind.FREE_GATHERED, self.label))

    def outer_all_gather(self, stream: SideStream, coll: Collectives,
                         after: Sequence[Event]) -> Event:
        """hfsdp: rebuild the inner shard from every outer rank's updated ``main`` chunk
        (float8 weights: their float8 bytes, cast with their scales)."""
        self.check_float8_scales()

        def run() -> None:
            lo, n = self.chunk_offset, self.main.numel()
            chunk = self.inner_shard[lo:lo + n]
            if self.float8 is not None:
                start = self.inner_lo + lo
                self.float8.cast(chunk, self.main, self.layout.pieces(start, start + n))
            elif chunk.data_ptr() != self.main.data_ptr():
                chunk.copy_(self.main)  # cast to param dtype
            coll.all_gather(as_bytes(self.inner_shard), as_bytes(chunk), self.comms.outer,
                            "outer")
        self.synced_version = self.version()
        self.params_ready = stream.submit(run, after,
                                          label(OpKind.OUTER_ALL_GATHER, self.label))
        return self.params_ready

    def copy_in(self) -> torch.Tensor:
        """On compute: the reduce-scatter input, i.e. the unsharded grads laid out flat, plus
        those kept by ``keep_local`` (the reductions average them over all DP ranks)."""
        rs_in = torch.empty(self.layout.total, dtype=self.reduce_dtype,
                            device=self.main.device)
        # One split into every parameter's and padding's view, and list comprehensions:
        # this runs for every group in every backward, on the host's critical path.
        views = rs_in.split(self._segment_sizes)
        grads = [p.grad for p in self.unsharded]
        for p in self.unsharded:
            p.grad = None
        dst = [views[j] for j, g in zip(self._param_segments, grads) if g is not None]
        src = [grad_local(g, s).reshape(-1) for g, s in zip(grads, self.tp_specs)
               if g is not None]
        zero = [views[j] for j in self._gap_segments]
        zero += [views[j] for j, g in zip(self._param_segments, grads) if g is None]
        self.used = [u or g is not None for u, g in zip(self.used, grads)]
        if dst:
            torch._foreach_copy_(dst, src)
        if zero:
            torch._foreach_zero_(zero)
        if self.local_grads is not None:  # gradients of microbatches that ran without sync
            rs_in.add_(self.local_grads)
            self.local_grads = None
        return rs_in

    def reduce_scatter(self, stream: SideStream, coll: Collectives, rs_in: torch.Tensor,
                       first: bool, after: Sequence[Event], outer_next: bool = False) -> Event:
        """Inner reduce-scatter of ``rs_in`` into ``accum`` (overwrite on the first
        microbatch of a step, accumulate after). ``outer_next``: ``outer_reduce`` follows
        in this step; hsdp's all-reduce then takes the reduce-dtype result as it is and
        casts it into ``accum`` once (as FSDP2 does), instead of a cast into ``accum``
        here and two around the all-reduce (same values: the result is exact in both)."""
        def run() -> None:
            _allocate(self.accum)
            direct = first and self.reduce_dtype == self.accum.dtype
            out = self.accum if direct else torch.empty(
                self.layout.shard_numel, dtype=self.reduce_dtype, device=rs_in.device)
            coll.reduce_scatter(out, rs_in, self.comms.inner_rs, "inner",
                                avg=self.divide_factor is None)
            if self.divide_factor not in (None, 1.0):
                out.div_(self.divide_factor)
            if first and not direct and outer_next and not self.shard_outer:
                self._to_outer = out
            elif first and not direct:
                self.accum.copy_(out)
            elif not first:
                self.accum.add_(out)
        self.reduced = True
        self.grads_live = True
        return stream.submit(run, after, label(OpKind.REDUCE_SCATTER, self.label))

    @property
    def outer_reduction(self) -> OpKind:
        """hfsdp's outer reduce-scatter, else hsdp's outer all-reduce (compressed ones with
        ``outer_reduce``)."""
        if self.compressed is not None:
            return (OpKind.OUTER_Q_REDUCE_SCATTER if self.shard_outer
                    else OpKind.OUTER_Q_ALL_REDUCE)
        return OpKind.OUTER_REDUCE_SCATTER if self.shard_outer else OpKind.OUTER_ALL_REDUCE

    @property
    def has_outer_reduction(self) -> bool:
        """False for hsdp on one outer rank: ``accum`` is already the reduced gradient (an
        outer reduction would only cast it to the reduce dtype and back). Always True
        with fault tolerance: replica groups may join at any step. False with DiLoCo
        (``init_mesh(outer_sync=...)``): each outer replica trains alone between syncs."""
        if self.comms.outer_sync is not None:
            return False
        return self.shard_outer or self.comms.outer_size > 1 or self.comms.elastic is not None

    def outer_reduce(self, stream: SideStream, coll: Collectives,
                     after: Sequence[Event]) -> Event:
        """Outer all-reduce of ``accum`` (hsdp) or outer reduce-scatter into ``grad_buf``;
        compressed ones (``compressed.py``) with ``outer_reduce``."""
        def run() -> None:
            _allocate(self.accum)  # a replayed reduction may find it freed
            src, self._to_outer = self._to_outer, None  # the inner result, if left for us
            if src is not None:
                stream.hold(src)  # allocated on rs: not reused before this stream is done
            elif self.compressed is not None:
                src = self.accum  # quantized from fp32 (it is the accumulated gradient)
            else:
                src = self.accum.to(self.reduce_dtype)  # no copy when dtypes match
            avg = self.divide_factor is None
            if self.compressed is not None:  # fp32 sums straight into the fp32 buffers
                _allocate(self.grad_buf)
                reduce = (self.compressed.reduce_scatter if self.shard_outer
                          else self.compressed.all_reduce)
                reduce(coll, self.grad_buf, src, self.comms.outer, avg)
            elif self.shard_outer:
                _allocate(self.grad_buf)
                out = self.grad_buf if self.grad_buf.dtype == src.dtype else torch.empty(
                    self.grad_buf.numel(), dtype=src.dtype, device=src.device)
                coll.reduce_scatter(out, src, self.comms.outer, "outer", avg=avg)
                if out is not self.grad_buf:
                    self.grad_buf.copy_(out)
            else:
                coll.all_reduce(src, self.comms.grad_outer, "outer", avg=avg)
                if src is not self.accum:
                    self.accum.copy_(src)
        return stream.submit(run, after, label(self.outer_reduction, self.label))

    def release_grads(self, accum_stream: SideStream, grad_buf_stream: SideStream,
                      after: Sequence[Event]) -> None:
        """Free ``accum`` and ``grad_buf`` on the given streams (the op table's
        ``FREE_ACCUM`` and ``FREE_GRAD_BUF``); ``after`` must cover every reader (the
        optimizer on compute)."""
        frees = ((self.accum, accum_stream, OpKind.FREE_ACCUM),
                 (self.grad_buf, grad_buf_stream, OpKind.FREE_GRAD_BUF))
        for buf, stream, kind in frees[:2 if self.shard_outer else 1]:
            stream.submit(lambda b=buf: b.untyped_storage().resize_(0), after,
                          label(kind, self.label))
        self.grads_live = False

    def full_flat(self, coll: Collectives) -> torch.Tensor:
        """The whole flat buffer in the original dtype (host-side collectives on compute)."""
        shard = self.main
        if self.shard_outer:
            shard = torch.empty(self.layout.shard_numel, dtype=self.orig_dtype,
                                device=self.main.device)
            coll.all_gather(shard, self.main, self.comms.host_outer, "outer")
        full = torch.empty(self.layout.total, dtype=self.orig_dtype, device=self.main.device)
        coll.all_gather(full, shard, self.comms.host_inner, "inner")
        return full
