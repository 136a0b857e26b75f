"""One unit's parameter group: flat buffers, sharded / unsharded views, its collectives.

A group holds the parameters of one unit that share a dtype and requires_grad. This file
knows HOW to gather, reduce and swap one group; ``schedule.py`` decides WHEN, on which
stream and after which events.

Buffers (S = inner shard, C = optimizer chunk, N = whole group; see ``layout.py``):
- ``main``       [C] original dtype: what the optimizer updates. ``model.parameters()``
                 yields one DTensor per original parameter whose local tensor is a 1-D
                 view of it (possibly empty); see ``pieces.py``.
- ``ag_src``     [S] param dtype: the inner shard fed to the inner all-gather.
                 hsdp: ``main`` itself (cast while copying into the gathered buffer).
                 hfsdp: ``inner_shard``, refreshed by the outer all-gather of ``main``.
- ``gathered``   [N] param dtype, transient: allocated by the all-gather, freed by
                 ``reshard``; unsharded parameters are views into it.
- ``accum``      [S] original dtype: the inner reduce-scatter accumulates microbatches here;
                 hsdp's outer all-reduce runs on it in place, so it is also hsdp's grad.
- ``grad_buf``   [C]: hfsdp's outer reduce-scatter output (hsdp: ``accum``).
``accum`` and ``grad_buf`` exist from the step's first reduce-scatter until the user has
cleared the gradients (``zero_grad``) and the next step starts: allocated by the stream
that first writes them, freed by ``release_grads``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn as nn

from hsdp.mesh import CommGroups
from hsdp.policy import MixedPrecision
from hsdp.runtime.streams import Event, SideStream
from hsdp.sharding.comm import Collectives
from hsdp.sharding.layout import FlatLayout
from hsdp.sharding.pieces import (
    Piece,
    as_dtensor,
    attach_chunks,
    before_write,
    checkpoint_view,
    direct,
    piece_like,
    placeholders_if_empty,
    same_layout,
    spec,
)

Slot = tuple[nn.Module, str]


def _alias(storage_of: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """A tensor over part of another's storage with its OWN version counter: writes
    through the base (collectives) do not bump it."""
    return torch.empty(0, dtype=storage_of.dtype, device=storage_of.device).set_(
        storage_of.untyped_storage(), storage_of.storage_offset() + offset, (numel,))


def _allocate(t: torch.Tensor) -> None:
    """Give ``t`` back its storage (on the current stream) if it was freed."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() < nbytes:
        t.untyped_storage().resize_(nbytes)


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


def owner(p: torch.Tensor) -> tuple[ParamGroup, int] | None:
    """(group, index in the group) of a sharded parameter hsdp manages, else None."""
    group = getattr(p, "_hsdp_group", None)
    return None if group is None else (group, p._hsdp_index)


class ParamGroup:
    def __init__(self, label: str, params: list[nn.Parameter], slots: list[list[Slot]],
                 comms: CommGroups, device: torch.device, shard_outer: bool,
                 mp: MixedPrecision) -> None:
        self.label = label
        self.slots = slots
        self.comms = comms
        self.mp = mp
        self.outer_requested = shard_outer  # the strategy's (only trainable groups get it)
        self.requires_grad = params[0].requires_grad
        self.orig_dtype = params[0].dtype
        self.param_dtype, self.reduce_dtype = mp.resolve(self.orig_dtype)
        self.shard_outer = shard_outer and self.requires_grad
        self.layout = lay = FlatLayout.build([tuple(p.shape) for p in params],
                                             comms.inner_size, comms.outer_size,
                                             self.shard_outer)
        i, o = comms.inner_rank, comms.outer_rank
        self.inner_lo, _ = lay.inner_range(i)
        owned_lo, owned_hi = lay.owned_range(o, i)
        S, C, N = lay.shard_numel, lay.chunk_numel, lay.total
        sources = [p.detach().reshape(-1) for p in params]
        for idx, p in enumerate(params):  # the originals: for ties and stale optimizers
            p._hsdp_moved_to = (self, idx)

        self.main = self._filled(sources, owned_lo, C, self.orig_dtype, device)
        if not self.shard_outer:
            self.ag_src = self.main
        else:
            self.inner_shard = self._filled(sources, self.inner_lo, S, self.param_dtype, device)
            self.chunk_offset = owned_lo - self.inner_lo
            if self.param_dtype == self.orig_dtype:  # main is a window of the inner shard
                self.main = _alias(self.inner_shard, self.chunk_offset, C)
            self.ag_src = self.inner_shard

        # Sharded parameters: DTensors over views of ``main``; registered on the modules.
        self.sharded: list[nn.Parameter] = []
        self._slices: list[tuple[int, int]] = []  # (offset in main, length) per parameter
        self._guard_hooks: list[int | None] = []  # id of _grad_on_shard's hook per parameter
        self.shard_starts: list[int] = []  # first element of each parameter held here
        self.specs = [spec(comms.mesh, self.shard_outer, shape, self.orig_dtype)
                      for shape in lay.shapes]
        owned = lay.pieces(owned_lo, owned_hi)
        # Hooks on the group's own tensors reach it weakly: a strong reference is a cycle
        # through autograd's C++ that gc cannot see (the model, and with it the process
        # groups' threads and sockets, would never be freed).
        me = weakref.ref(self)
        locals_ = placeholders_if_empty([self.main[pc.range_offset:pc.range_offset + pc.length]
                                         if pc else self.main[:0] for pc in owned])
        for shape, dspec, piece, local in zip(lay.shapes, self.specs, owned, locals_):
            a, n = (piece.range_offset, piece.length) if piece else (0, 0)
            start = piece.param_start if piece else 0
            sp = nn.Parameter(as_dtensor(local, dspec, start, n, self._piece_groups()),
                              requires_grad=self.requires_grad)
            attach_chunks(sp._local_tensor, shape, start, n)  # state_dict(keep_vars=True)
            sp._hsdp_group = self  # marks the parameter as managed by hsdp (see owner())
            sp._hsdp_index = len(self.sharded)
            guard = (sp.register_post_accumulate_grad_hook(
                         lambda p: me()._grad_on_shard(p))
                     if self.requires_grad else None)
            self._guard_hooks.append(None if guard is None else guard.id)
            self.sharded.append(sp)
            self._slices.append((a, n))
            self.shard_starts.append(start)
        self.synced_version: int | None = self.version()

        # Unsharded parameters: windows of the gathered buffer, whose storage comes and
        # goes; own version counters, so re-gathering for backward does not look like an
        # in-place change to autograd's saved tensors.
        self.gathered = torch.empty(N, dtype=self.param_dtype, device=device)
        self.unsharded = [
            nn.Parameter(_alias(self.gathered, off, p.numel()).view(p.shape),
                         requires_grad=self.requires_grad)
            for p, off in zip(params, lay.offsets)]
        self._gathered_bytes = N * self.gathered.element_size()
        self.gathered.untyped_storage().resize_(0)

        self.has_grads = False  # gradient state (buffers, hooks) made
        # None: gradients are means over the DP ranks; f: sums divided by f (FSDP2's
        # set_gradient_divide_factor; 1.0 gives plain sums).
        self.divide_factor: float | None = None
        self.on_all_grads: Callable[[ParamGroup], None] | None = None
        self.param_requires_grad = [p.requires_grad for p in params]
        self.trainable_count = sum(self.param_requires_grad)
        if self.requires_grad:
            self._init_grad_state()
        self.gathered_event: Event | None = None  # None: not gathered
        self.params_ready: Event | None = None  # hfsdp: last outer all-gather

    def _init_grad_state(self) -> None:
        S, C = self.layout.shard_numel, self.layout.chunk_numel
        device = self.main.device
        self.accum = torch.empty(S, dtype=self.orig_dtype, device=device)
        self.grad_buf = (torch.empty(C, dtype=self.orig_dtype, device=device)
                         if self.shard_outer else self.accum)
        # The sharded .grad DTensors, made once (while the storage exists), then freed.
        locals_ = placeholders_if_empty([self.grad_buf[a:a + n] for a, n in self._slices])
        self._grad_views = [as_dtensor(local, dspec, start, n, self._piece_groups())
                            for local, (_, n), dspec, start in zip(
                                locals_, self._slices, self.specs, self.shard_starts)]
        self._placeholder_grads = [g._local_tensor for g, (_, n) in
                                   zip(self._grad_views, self._slices) if n == 0]
        for buf in {id(b): b for b in (self.accum, self.grad_buf)}.values():
            buf.untyped_storage().resize_(0)
        self.grads_live = False  # host view: buffers allocated (or about to be)
        segments = self.layout.segments()
        self._segment_sizes = [n for n, _ in segments]
        self._gap_segments = [j for j, (_, i) in enumerate(segments) if i is None]
        self._param_segments = [j for j, (_, i) in enumerate(segments) if i is not None]
        self.received: set[int] = set()
        self.used = [False] * len(self.unsharded)  # got a gradient on this rank in this step
        self.local_grads: torch.Tensor | None = None  # unsynced microbatches' gradients
        self._to_outer: torch.Tensor | None = None  # reduce_scatter's result for outer_reduce
        self.carry: torch.Tensor | None = None  # [C]: uncleared .grads (see hide_grads)
        self.carried: list[bool] = []  # which parameters had a .grad then
        self.reduced = False
        me = weakref.ref(self)  # see __init__
        for idx, up in enumerate(self.unsharded):
            frozen = not up.requires_grad
            up.requires_grad_(True)  # a hook needs it
            up.register_post_accumulate_grad_hook(lambda _p, idx=idx: me()._on_grad(idx))
            up.requires_grad_(not frozen)
        self.has_grads = True

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad_`` changes made on the sharded parameters since
        fully_shard (FSDP2 does the same at each unshard): a frozen parameter gets no
        gradient, no reduction and no update; a group with none trainable is not reduced."""
        with direct():
            now = [p.requires_grad for p in self.sharded]
        if now == self.param_requires_grad:
            return
        if any(now) and not self.has_grads:
            if self.outer_requested:
                module, name = self.slots[now.index(True)][0]
                raise RuntimeError(
                    f"hsdp: {type(module).__name__}.{name} was frozen when fully_shard ran; "
                    f"with strategy='hfsdp' its shards cannot become trainable later (they "
                    f"are not sharded over outer). Set requires_grad before fully_shard.")
            self._init_grad_state()
        for up, flag in zip(self.unsharded, now):
            up.requires_grad_(flag)
        self.param_requires_grad = now
        self.trainable_count = sum(now)
        self.requires_grad = any(now)

    def version(self) -> int:
        """Changes when the sharded values were written through ``main`` (checkpoint
        loading) or by a non-foreach in-place op on a DTensor parameter (which bumps the
        parameter's own counter). Foreach ops on DTensors bump nothing: the optimizer
        step hook calls ``mark_written`` instead."""
        return self.main._version + sum(p._version for p in self.sharded)

    def mark_written(self) -> None:
        """hfsdp: the next refresh re-gathers the inner shard from every updated chunk."""
        self.synced_version = None

    def local(self, idx: int) -> torch.Tensor:
        """This rank's piece of parameter ``idx``: a 1-D view of ``main`` (writes into it
        bump ``main``'s version counter, which ``version`` watches)."""
        a, n = self._slices[idx]
        return self.main[a:a + n]

    def checkpoint_view(self, idx: int, local: torch.Tensor | None = None) -> torch.Tensor:
        """A DTensor for state dicts over ``local`` (by default parameter ``idx``'s piece),
        which must be laid out like that piece (e.g. its optimizer state)."""
        return checkpoint_view(self.sharded[idx], self.local(idx) if local is None else local)

    def _piece_groups(self) -> tuple:
        """The host groups over which this group's pieces are spread (see ``Piece``)."""
        return self.comms.piece_groups(self.shard_outer)

    def _filled(self, sources: list[torch.Tensor], lo: int, numel: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """``numel`` elements of the flat layout starting at ``lo``, padding zeroed (and
        where the source is on the meta device: no values yet)."""
        out = torch.zeros(numel, dtype=dtype, device=device)
        for src, pc in zip(sources, self.layout.pieces(lo, lo + numel)):
            if pc is not None and not src.is_meta:
                out[pc.range_offset:pc.range_offset + pc.length].copy_(
                    src[pc.param_start:pc.param_start + pc.length])
        return out

    # ------------------------------------------------------------------ swaps

    def use_unsharded(self) -> None:
        for slots, p in zip(self.slots, self.unsharded):
            for module, name in slots:
                module._parameters[name] = p

    def use_sharded(self) -> None:
        for slots, p in zip(self.slots, self.sharded):
            for module, name in slots:
                module._parameters[name] = p

    # ------------------------------------------------------------------ forward

    def unshard(self, stream: SideStream, coll: Collectives, after: Sequence[Event]) -> Event:
        """Allocate the gathered buffer on ``stream`` and inner all-gather into it."""
        def run() -> None:
            self.gathered.untyped_storage().resize_(self._gathered_bytes)
            chunk = self.gathered[self.inner_lo:self.inner_lo + self.layout.shard_numel]
            chunk.copy_(self.ag_src)  # cast to param dtype where it differs
            coll.all_gather(self.gathered, chunk, self.comms.inner_ag, "inner")
        self.gathered_event = stream.submit(run, after, f"AG:{self.label}")
        return self.gathered_event

    def reshard(self, stream: SideStream, after: Sequence[Event]) -> Event:
        """Free the gathered buffer on the stream that allocated it."""
        self.gathered_event = None
        return stream.submit(lambda: self.gathered.untyped_storage().resize_(0), after,
                             f"FREE:{self.label}")

    def outer_all_gather(self, stream: SideStream, coll: Collectives,
                         after: Sequence[Event]) -> Event:
        """hfsdp: rebuild the inner shard from every outer rank's updated ``main`` chunk."""
        def run() -> None:
            chunk = self.inner_shard[self.chunk_offset:self.chunk_offset + self.main.numel()]
            if chunk.data_ptr() != self.main.data_ptr():
                chunk.copy_(self.main)  # cast to param dtype
            coll.all_gather(self.inner_shard, chunk, self.comms.outer, "outer")
        self.synced_version = self.version()
        self.params_ready = stream.submit(run, after, f"OUTER_AG:{self.label}")
        return self.params_ready

    # ------------------------------------------------------------------ backward

    def _grad_on_shard(self, p: nn.Parameter) -> None:
        """Autograd reached a sharded parameter: it was used outside its unit's forward
        (e.g. through ``to_local()`` in a loss term), where its gradient would be lost."""
        module, name = self.slots[p._hsdp_index][0]
        raise RuntimeError(
            f"hsdp: a gradient reached the sharded {type(module).__name__}.{name} (group "
            f"{self.label}) directly: it was used outside the forward of the unit that owns "
            f"it, where hsdp would lose that gradient. Use it inside that unit's forward, or "
            f"fully_shard the module that uses it together with it (their common parent).")

    def _on_grad(self, idx: int) -> None:
        if self.reduced:
            raise RuntimeError(
                f"hsdp: parameter {idx} of group {self.label} received a gradient after the "
                f"group was reduce-scattered in this backward (is it used outside its unit, "
                f"or both inside and outside a reentrant checkpoint?). Make it belong to the "
                f"unit that uses it.")
        self.received.add(idx)
        if len(self.received) == self.trainable_count and self.on_all_grads is not None:
            self.on_all_grads(self)

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
        src = [g.reshape(-1) for g in grads if g is not None]
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

    def keep_local(self, flat: torch.Tensor) -> None:
        """A microbatch without gradient sync: keep ``copy_in``'s result (which includes
        the earlier unsynced microbatches') on this rank for the next synced one."""
        self.local_grads = flat
        self.reduced = True

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
        return stream.submit(run, after, f"RS:{self.label}")

    @property
    def has_outer_reduction(self) -> bool:
        """False for hsdp on one outer rank: ``accum`` is already the reduced gradient (an
        outer reduction would only cast it to the reduce dtype and back)."""
        return self.shard_outer or self.comms.outer_size > 1

    def outer_reduce(self, stream: SideStream, coll: Collectives,
                     after: Sequence[Event]) -> Event:
        """Outer all-reduce of ``accum`` (hsdp) or outer reduce-scatter into ``grad_buf``."""
        def run() -> None:
            _allocate(self.accum)  # a replayed reduction may find it freed
            src, self._to_outer = self._to_outer, None  # the inner result, if left for us
            if src is not None:
                stream.hold(src)  # allocated on rs: not reused before this stream is done
            else:
                src = self.accum.to(self.reduce_dtype)  # no copy when dtypes match
            if self.shard_outer:
                _allocate(self.grad_buf)
                out = self.grad_buf if self.grad_buf.dtype == src.dtype else torch.empty(
                    self.grad_buf.numel(), dtype=src.dtype, device=src.device)
                coll.reduce_scatter(out, src, self.comms.outer, "outer",
                                    avg=self.divide_factor is None)
                if out is not self.grad_buf:
                    self.grad_buf.copy_(out)
            else:
                coll.all_reduce(src, self.comms.outer, "outer", avg=self.divide_factor is None)
                if src is not self.accum:
                    self.accum.copy_(src)
        kind = "OUTER_RS" if self.shard_outer else "OUTER_AR"
        return stream.submit(run, after, f"{kind}:{self.label}")

    def release_grads(self, rs: SideStream, outer: SideStream, after: Sequence[Event]) -> None:
        """Free ``accum`` (on rs) and ``grad_buf`` (on outer), the streams that allocate
        them; ``after`` must cover every reader (the optimizer on compute)."""
        for buf, stream in ((self.accum, rs), (self.grad_buf, outer)):
            stream.submit(lambda b=buf: b.untyped_storage().resize_(0), after,
                          f"FREE_GRAD:{self.label}")
            if not self.shard_outer:
                break
        self.grads_live = False

    def grads_exposed(self) -> bool:
        with direct():
            return any(p.grad is not None for p in self.sharded)

    def run_grad_hooks(self) -> None:
        """The users' post-accumulate-grad hooks of the sharded parameters that have a
        ``.grad`` (set by ``expose_grads``, final), in parameter order, as FSDP2 runs
        them after its reduction; not hsdp's own guard (``_grad_on_shard``)."""
        for p, guard in zip(self.sharded, self._guard_hooks):
            with direct():
                hooks = getattr(p, "_post_accumulate_grad_hooks", None)
                if not hooks or p.grad is None:
                    continue
            for hook_id, hook in list(hooks.items()):
                if hook_id != guard:
                    hook(p)

    def reset_backward(self) -> None:
        self.received.clear()
        self.reduced = False

    def abandon_step(self) -> None:
        """Forget what a failed step left: gradients (unsharded, and sharded ones, which may be
        the last step's or set by autograd), received / used flags."""
        for p in (*self.unsharded, *self.sharded):
            p.grad = None
        self.used = [False] * len(self.used)
        self.local_grads = None
        self._to_outer = None
        self.carry = None
        self.reset_backward()

    def expose_grads(self, used: Sequence[bool]) -> None:
        """Hand the reduced gradients to the optimizer; a parameter that no rank used
        keeps ``.grad = None`` (as with DDP)."""
        if self._placeholder_grads:  # zero, whatever the user did to them last step
            torch._foreach_zero_(self._placeholder_grads)
        if self.carry is not None:  # the gradients left set before this step's backward
            self.grad_buf.add_(self.carry)
            used = [u or c for u, c in zip(used, self.carried)]
            self.carry = None
        with direct():
            for p, v, u in zip(self.sharded, self._grad_views, used):
                p.grad = v if u else None
        self.used = [False] * len(self.used)

    def hide_grads(self) -> None:
        """Take the sharded ``.grad``s off before a step's first backward. What they hold,
        if they were not cleared (still set, not all zero), is kept in ``carry`` and added
        to the new reduced gradients by ``expose_grads``, as torch accumulates into a
        ``.grad`` left set. Reads the values (a device sync) only when some are set."""
        with direct():
            grads = [p.grad for p in self.sharded]
            for p in self.sharded:
                p.grad = None
        self.carry = None
        if all(g is None for g in grads):
            return
        # Our views live in grad_buf; read it only while it is live (a .grad autograd put
        # on a shard may be set while the buffers are freed).
        carry = (self.grad_buf.clone() if self.grads_live
                 else torch.zeros_like(self.grad_buf))
        for idx, (g, view, (a, n)) in enumerate(zip(grads, self._grad_views, self._slices)):
            if g is None:
                carry[a:a + n].zero_()
            elif g is not view and n:
                carry[a:a + n].copy_(self._foreign_grad(idx, g))
        if carry.any():
            self.carry, self.carried = carry, [g is not None for g in grads]

    def _foreign_grad(self, idx: int, g: torch.Tensor) -> torch.Tensor:
        """The local piece of a ``.grad`` the user set on sharded parameter ``idx``."""
        p = self.sharded[idx]
        if not same_layout(g, p):
            module, name = self.slots[idx][0]
            raise RuntimeError(
                f"hsdp: the .grad of {type(module).__name__}.{name} was replaced by a tensor "
                f"not laid out like its shard (shape {tuple(g.shape)}), so the next backward "
                f"cannot accumulate into it. Clear it (optimizer.zero_grad()) or set it to a "
                f"tensor like the parameter (torch.zeros_like(p)).")
        return g._local_tensor.reshape(-1)[:self._slices[idx][1]]

    # ------------------------------------------------------------------ state

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
        (identical on every rank; no communication)."""
        lo, hi = self.layout.owned_range(self.comms.outer_rank, self.comms.inner_rank)
        before_write(self.sharded)
        self.main.copy_(flat[lo:hi])
        if self.shard_outer:
            self.inner_shard.copy_(flat[self.inner_lo:self.inner_lo + self.layout.shard_numel])
        self.synced_version = self.version()  # the inner shard is up to date

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
