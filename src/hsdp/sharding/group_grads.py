"""A parameter group's gradient state and its reductions: the gradient buffers, which
parameters got a gradient, the gradients kept without sync, the copy-in and the inner and
outer reductions (HOW; ``runtime/schedule.py`` decides WHEN, on which stream), and the
sharded ``.grad``s carried across steps, exposed to and hidden from the optimizer."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from hsdp.sharding.comm import Collectives
from hsdp.sharding.compressed import CompressedOuter
from hsdp.sharding.group_buffers import GroupBuffers
from hsdp.sharding.group_param import GroupParam
from hsdp.sharding.pieces import as_dtensor, placeholders_if_empty, same_layout
from hsdp.sharding.tp_blocks import grad_local
from hsdp.sharding.write_guard import direct
from hsdp.streams.capture import capture_refusal
from hsdp.streams.contract import Event, SideStream
from hsdp.streams.op_table import OpKind, label
from hsdp.topology.liveness import note_gone


def _allocate(t: torch.Tensor) -> None:
    """Give ``t`` back its storage (on the current stream) if it was freed."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() < nbytes:
        t.untyped_storage().resize_(nbytes)


class GradientState:
    """The gradients of one trainable group (made when the group first has a trainable
    parameter). ``all_in`` is called once every trainable parameter got its gradient in
    a backward; ``compressed``: the compressed outer reduction (None: the exact one);
    ``every_step``: False where the outer modes reduce nothing in the backward."""

    def __init__(self, buffers: GroupBuffers, compressed: CompressedOuter | None,
                 trainable_count: int, all_in: Callable[[], None],
                 every_step: bool = True) -> None:
        self.b = b = buffers
        self.compressed = compressed
        self.every_step = every_step
        self.trainable_count = trainable_count
        self._all_in = all_in
        # FSDP2's set_all_reduce_hook: called with the outer all-reduce's result (hsdp)
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        S, C = b.layout.shard_numel, b.layout.chunk_numel
        device = b.main.device
        self.accum = torch.empty(S, dtype=b.orig_dtype, device=device)
        self.grad_buf = (torch.empty(C, dtype=b.orig_dtype, device=device)
                         if b.shard_outer else self.accum)
        # The sharded .grad DTensors, made once (while the storage exists), then freed.
        self._grad_views, self._placeholder_grads = _grad_views(b, self.grad_buf)
        for buf in {id(t): t for t in (self.accum, self.grad_buf)}.values():
            buf.untyped_storage().resize_(0)
        self.grads_live = False  # host view: buffers allocated (or about to be)
        segments = b.layout.segments()
        self._segment_sizes = [n for n, _ in segments]
        self._gap_segments = [j for j, (_, i) in enumerate(segments) if i is None]
        self._param_segments = [j for j, (_, i) in enumerate(segments) if i is not None]
        self.received: set[int] = set()
        self.used = [False] * len(b.params)  # got a gradient on this rank in this step
        self.local_grads: torch.Tensor | None = None  # unsynced microbatches' gradients
        self._to_outer: torch.Tensor | None = None  # reduce_scatter's result for reduce_outer
        self.carry: torch.Tensor | None = None  # [C]: uncleared .grads (see hide_grads)
        self.carry_in_buf = False  # ... left in grad_buf instead, added by reduce_outer
        self.carried: list[bool] = []  # which parameters had a .grad then
        self.reduced = False
        _hook_unsharded(self)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None) -> None:
        """FSDP2's ``set_all_reduce_hook``: ``hook`` runs on the outer all-reduce's result."""
        self.all_reduce_hook = hook

    def set_trainable(self, count: int) -> None:
        """The group's number of trainable parameters changed (``requires_grad_``)."""
        self.trainable_count = count

    def _on_grad(self, idx: int) -> None:
        if self.reduced:
            raise RuntimeError(
                f"hsdp: parameter {idx} of group {self.b.label} received a gradient after the "
                f"group was reduce-scattered in this backward (is it used outside its unit, "
                f"or both inside and outside a reentrant checkpoint?). Make it belong to the "
                f"unit that uses it.")
        self.received.add(idx)
        if len(self.received) == self.trainable_count:
            try:
                self._all_in()
            except Exception as exc:  # a collective that lost its peer: name who is gone
                note_gone(exc)
                raise

    def keep_local(self, flat: torch.Tensor) -> None:
        """A microbatch without gradient sync: keep ``copy_in``'s result (which includes
        the earlier unsynced microbatches') on this rank for the next synced one."""
        self.local_grads = flat
        self.reduced = True

    def copy_in(self) -> torch.Tensor:
        """On compute: the reduce-scatter input, i.e. the unsharded grads laid out flat, plus
        those kept by ``keep_local`` (the reductions average them over all DP ranks)."""
        rs_in = torch.empty(self.b.layout.total, dtype=self.b.reduce_dtype,
                            device=self.b.main.device)
        # One split into every parameter's and padding's view, and list comprehensions:
        # this runs for every group in every backward, on the host's critical path.
        views = rs_in.split(self._segment_sizes)
        unsharded = [q.unsharded for q in self.b.params]
        grads = [p.grad for p in unsharded]
        for p in unsharded:
            p.grad = None
        dst = [views[j] for j, g in zip(self._param_segments, grads) if g is not None]
        src = [grad_local(g, q.tp_spec).reshape(-1) for g, q in zip(grads, self.b.params)
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
                       first: bool, after: Sequence[Event], divide: float | None,
                       outer_next: bool = False) -> Event:
        """Inner reduce-scatter of ``rs_in`` into ``accum`` (overwrite on the first
        microbatch of a step, accumulate after). ``outer_next``: ``reduce_outer`` follows
        in this step; hsdp's all-reduce then takes the reduce-dtype result as it is and
        casts it into ``accum`` once (as FSDP2 does), instead of a cast into ``accum``
        here and two around the all-reduce (same values: the result is exact in both).
        ``divide``: the group's divide factor (None: the collectives average)."""
        def run() -> None:
            _allocate(self.accum)
            direct = first and self.b.reduce_dtype == self.accum.dtype
            out = self.accum if direct else torch.empty(
                self.b.layout.shard_numel, dtype=self.b.reduce_dtype, device=rs_in.device)
            coll.reduce_scatter(out, rs_in, self.b.comms.inner_rs, "inner",
                                avg=divide is None)
            if divide not in (None, 1.0):
                out.div_(divide)
            if first and not direct and outer_next and not self.b.shard_outer:
                self._to_outer = out
            elif first and not direct:
                self.accum.copy_(out)
            elif not first:
                self.accum.add_(out)
        self.reduced = True
        self.grads_live = True
        return stream.submit(run, after, label(OpKind.REDUCE_SCATTER, self.b.label))

    @property
    def outer_reduction(self) -> OpKind:
        """hfsdp's outer reduce-scatter, else hsdp's outer all-reduce (their compressed
        forms with a codec)."""
        if self.compressed is not None:  # the kind its mode issues
            return self.compressed.op_kind(self.b.shard_outer)
        return OpKind.OUTER_REDUCE_SCATTER if self.b.shard_outer else OpKind.OUTER_ALL_REDUCE

    @property
    def has_outer_reduction(self) -> bool:
        """False for hsdp on one outer rank: ``accum`` is already the reduced gradient (an
        outer reduction would only cast it to the reduce dtype and back). Always True
        with fault tolerance (replica groups may join at any step) and with an all-reduce
        hook (FSDP2 calls it after the reduce-scatter when there is no all-reduce). False
        where the outer modes reduce nothing per step (``every_step``: between an outer
        schedule's syncs each replica trains alone)."""
        c = self.b.comms
        if not self.every_step:
            return False
        return (self.b.shard_outer or c.outer_size > 1 or c.elastic is not None
                or self.all_reduce_hook is not None)

    def reduce_outer(self, stream: SideStream, coll: Collectives, after: Sequence[Event],
                     divide: float | None) -> Event:
        """Outer all-reduce of ``accum`` (hsdp) or outer reduce-scatter into ``grad_buf``;
        compressed ones with a codec (``compressed.py``)."""
        def run() -> None:
            _allocate(self.accum)  # a replayed reduction may find it freed
            src, self._to_outer = self._to_outer, None  # the inner result, if left for us
            if src is not None:
                stream.hold(src)  # allocated on rs: not reused before this stream is done
            elif self.compressed is not None:
                src = self.accum  # quantized from fp32 (it is the accumulated gradient)
            else:
                src = self.accum.to(self.b.reduce_dtype)  # no copy when dtypes match
            avg = divide is None
            if self.compressed is not None:  # fp32 sums straight into the fp32 buffers
                _allocate(self.grad_buf)
                reduce = (self.compressed.reduce_scatter if self.b.shard_outer
                          else self.compressed.all_reduce)
                reduce(coll, self.grad_buf, src, self.b.comms.outer, avg)
            elif self.b.shard_outer:
                _allocate(self.grad_buf)
                out = self.grad_buf if self.grad_buf.dtype == src.dtype else torch.empty(
                    self.grad_buf.numel(), dtype=src.dtype, device=src.device)
                coll.reduce_scatter(out, src, self.b.comms.outer, "outer", avg=avg)
                if out is not self.grad_buf:
                    self.grad_buf.copy_(out)
            else:
                coll.all_reduce(src, self.b.comms.grad_outer, "outer", avg=avg)
                if self.all_reduce_hook is not None:
                    self.all_reduce_hook(src)
                if self.carry_in_buf:  # accum holds the uncleared .grads (hide_grads)
                    self.accum.add_(src)
                elif src is not self.accum:
                    self.accum.copy_(src)
        return stream.submit(run, after, label(self.outer_reduction, self.b.label))

    def release_grads(self, accum_stream: SideStream, grad_buf_stream: SideStream,
                      after: Sequence[Event]) -> None:
        """Free ``accum`` and ``grad_buf`` on the given streams (the op table's
        ``FREE_ACCUM`` and ``FREE_GRAD_BUF``); ``after`` must cover every reader (the
        optimizer on compute)."""
        frees = ((self.accum, accum_stream, OpKind.FREE_ACCUM),
                 (self.grad_buf, grad_buf_stream, OpKind.FREE_GRAD_BUF))
        for buf, stream, kind in frees[:2 if self.b.shard_outer else 1]:
            stream.submit(lambda b=buf: b.untyped_storage().resize_(0), after,
                          label(kind, self.b.label))
        self.grads_live = False

    def grads_exposed(self) -> bool:
        with direct():
            return any(q.sharded.grad is not None for q in self.b.params)

    def run_grad_hooks(self) -> None:
        """The users' post-accumulate-grad hooks of the sharded parameters that have a
        ``.grad`` (set by ``expose_grads``, final), in parameter order, as FSDP2 runs
        them after its reduction; not hsdp's own guard (``_grad_on_shard``)."""
        for q in self.b.params:
            p = q.sharded
            with direct():
                hooks = getattr(p, "_post_accumulate_grad_hooks", None)
                if not hooks or p.grad is None:
                    continue
            for hook_id, hook in list(hooks.items()):
                if hook_id != q.guard_hook:
                    hook(p)

    def reset_backward(self) -> None:
        self.received.clear()
        self.reduced = False

    def abandon_step(self) -> None:
        """Forget what a failed step left: gradients (unsharded, and sharded ones, which may be
        the last step's or set by autograd), received / used flags."""
        for q in self.b.params:
            q.unsharded.grad = q.sharded.grad = None
        self.used = [False] * len(self.used)
        self.local_grads = None
        self._to_outer = None
        self.carry = None
        self.carry_in_buf = False
        if self.compressed is not None:
            self.compressed.drop()
        self.reset_backward()

    def expose_grads(self, used: Sequence[bool]) -> None:
        """Hand the reduced gradients to the optimizer; a parameter that no rank used
        keeps ``.grad = None`` (as with DDP)."""
        if self._placeholder_grads:  # zero, whatever the user did to them last step
            torch._foreach_zero_(self._placeholder_grads)
        if self.carry is not None or self.carry_in_buf:  # .grads left set before the step
            if self.carry is not None:
                self.grad_buf.add_(self.carry)
            used = [u or c for u, c in zip(used, self.carried)]
            self.carry, self.carry_in_buf = None, False
        self.expose_used(used)
        self.used = [False] * len(self.used)

    def applied(self) -> None:
        """An optimizer stepped: if the reduced gradients were still set (not cleared by
        ``zero_grad(set_to_none=True)``), the compressed reduction's residual of them is
        the state now (``compressed.py``)."""
        if self.compressed is not None and self.grads_exposed():
            self.compressed.commit()

    def expose_used(self, used: Sequence[bool]) -> None:
        """Set the ``.grad`` of each parameter some rank used to its view of the reduced
        gradients, the others' to None (host only)."""
        with direct():
            for q, v, u in zip(self.b.params, self._grad_views, used):
                q.sharded.grad = v if u else None

    def hide_grads(self, capturing: bool = False, single: bool = False) -> None:
        """Take the sharded ``.grad``s off before a step's first backward. What they hold,
        if they were not cleared (still set, not all zero), is kept in ``carry`` and added
        to the new reduced gradients by ``expose_grads``, as torch accumulates into a
        ``.grad`` left set. Reads the values (a device sync) only when some are set, and
        ``capturing`` (a CUDA graph) not: the graph then always adds them (zeros, when
        cleared in place), whatever they hold at each replay. ``single``: this backward
        is the step's only one; then, where the step's gradients reach ``accum`` in one
        write (``_adds_in_place``), they stay in ``grad_buf`` and that write adds to them
        (the same sums, without a copy of them). Gradients not carried (cleared, or all
        zero) were discarded without an optimizer step, and their residual with them."""
        with direct():
            grads = [q.sharded.grad for q in self.b.params]
            for q in self.b.params:
                q.sharded.grad = None
        self.carry, self.carry_in_buf = None, False
        if all(g is None for g in grads):
            if self.compressed is not None:  # cleared: so is their residual
                self.compressed.drop()
            return
        in_buf = capturing and single and self.grads_live and _adds_in_place(self)
        # Our views live in grad_buf; read it only while it is live (a .grad autograd put
        # on a shard may be set while the buffers are freed).
        carry = (self.grad_buf if in_buf else self.grad_buf.clone() if self.grads_live
                 else torch.zeros_like(self.grad_buf))
        for q, g, view in zip(self.b.params, grads, self._grad_views):
            a, n = q.offset, q.length
            if g is None:
                carry[a:a + n].zero_()
            elif g is not view and n:
                if capturing:
                    raise capture_refusal(
                        f"a .grad of group {self.b.label} replaced by another tensor",
                        "clear gradients in place (zero_grad(set_to_none=False))")
                carry[a:a + n].copy_(_foreign_local(q, g))
        if in_buf:
            self.carry_in_buf, self.carried = True, [g is not None for g in grads]
        elif capturing or carry.any():
            self.carry, self.carried = carry, [g is not None for g in grads]
        else:
            if self.compressed is not None:  # cleared: so is their residual
                self.compressed.drop()



def _grad_views(b: GroupBuffers, grad_buf: torch.Tensor
                ) -> tuple[list[DTensor], list[torch.Tensor]]:
    """The sharded ``.grad`` DTensors over ``grad_buf``, and the local tensors of those that
    hold no element on this rank (placeholders)."""
    locals_ = placeholders_if_empty([grad_buf[q.offset:q.offset + q.length]
                                     for q in b.params])
    views = [as_dtensor(local, q.spec, q.start, q.length)
             for local, q in zip(locals_, b.params)]
    return views, [g._local_tensor for g, q in zip(views, b.params) if q.length == 0]


def _foreign_local(q: GroupParam, g: torch.Tensor) -> torch.Tensor:
    """The local piece of a ``.grad`` the user set on the sharded parameter of ``q``."""
    if not same_layout(g, q.sharded):
        raise RuntimeError(
            f"hsdp: the .grad of {q.name} was replaced by a tensor "
            f"not laid out like its shard (shape {tuple(g.shape)}), so the next backward "
            f"cannot accumulate into it. Clear it (optimizer.zero_grad()) or set it to a "
            f"tensor like the parameter (torch.zeros_like(p)).")
    return g._local_tensor.reshape(-1)[:q.length]


def _hook_unsharded(state: GradientState) -> None:
    """A post-accumulate-grad hook on each unsharded parameter. Hooks on the group's
    own tensors reach it weakly: a strong reference is a cycle through autograd's C++
    that gc cannot see."""
    me = weakref.ref(state)
    for idx, up in enumerate(q.unsharded for q in state.b.params):
        frozen = not up.requires_grad
        up.requires_grad_(True)  # a hook needs it
        up.register_post_accumulate_grad_hook(lambda _p, idx=idx: me()._on_grad(idx))
        up.requires_grad_(not frozen)


def _adds_in_place(state: GradientState) -> bool:
    """Whether a step of one backward writes its gradients into ``accum`` once, at the
    end: hsdp's exact outer all-reduce of the reduce-scatter's own reduce-dtype result,
    cast into ``accum`` (``reduce_scatter``'s ``outer_next``), which can add instead."""
    b = state.b
    return (state.compressed is None and not b.shard_outer
            and b.reduce_dtype != state.accum.dtype and state.has_outer_reduction)
