"""One unit's parameter group: flat buffers, sharded / unsharded views, its collectives.

A group holds the parameters of one unit that share a dtype and requires_grad. It builds
its buffers (``GroupBuffers``, ``group_buffers.py``) and hands them to its parts: its
all-gathers (``gather``: ``GroupGather``, ``group_gather.py``), its gradient state and
reductions (``grads``: ``GradientState``, ``group_grads.py``) and its state I/O (``state``:
``GroupIO``, ``group_io.py``). They do HOW; ``runtime/schedule.py`` and
``runtime/gather.py`` decide WHEN, on which stream and after which events.

Buffers (S = inner shard, C = optimizer chunk, N = whole group; see ``layout.py``):
- ``main``       [C] original dtype: what the optimizer updates. ``model.parameters()``
                 yields one DTensor per original parameter whose local tensor is a 1-D
                 view of it (possibly empty); see ``pieces.py``.
- ``ag_src``     [S] param dtype: the inner shard fed to the inner all-gather.
                 hsdp: ``main`` itself (cast while copying into the gathered buffer).
                 hfsdp: ``inner_shard``, refreshed by the outer all-gather of ``main``.
- ``gathered``   [N] param dtype, transient: allocated by the all-gather, freed by
                 ``reshard``; unsharded parameters are views into it.
A group of torchao float8 weights (``float8.py``) gathers float8 bytes: ``gathered`` and
hfsdp's ``inner_shard`` are float8, cast from ``main`` with the weights' global scales.
Gradient buffers (``grads``, made with the first trainable parameter):
- ``accum``      [S] original dtype: the inner reduce-scatter accumulates microbatches here;
                 hsdp's outer all-reduce runs on it in place, so it is also hsdp's grad.
- ``grad_buf``   [C]: hfsdp's outer reduce-scatter output (hsdp: ``accum``).
The group's outer modes (``outer``; ``topology/outer_mode.py``) attach their state to it:
the compressed outer reduction's codec (``compressed``: an fp32 error-feedback residual of
about S elements), hfsdp's compressed outer all-gather (``compressed_gather``: the inner
shard then holds dequantized weights and is never ``main``'s storage, even where the
dtypes match), DiLoCo's anchor (``anchor``: fp32 anchor and momentum of C elements; no
outer reduction per step).
``accum`` and ``grad_buf`` exist from the step's first reduce-scatter until the user has
cleared the gradients (``zero_grad``) and the next step starts: allocated by the stream
that first writes them, freed by ``release_grads``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hsdp.sharding.anchor import Anchor
from hsdp.sharding.chunks import attach_chunks, save_from_other_replica
from hsdp.sharding.comm import Collectives
from hsdp.sharding.compressed import CompressedOuter
from hsdp.sharding.compressed_gather import CompressedGather
from hsdp.sharding.float8_weights import Float8Weights, float8_dtype
from hsdp.sharding.group_buffers import GroupBuffers
from hsdp.sharding.group_gather import GroupGather
from hsdp.sharding.group_grads import GradientState
from hsdp.sharding.group_io import GroupIO
from hsdp.sharding.layout import FlatLayout
from hsdp.sharding.pieces import as_dtensor, placeholders_if_empty, spec
from hsdp.sharding.policy import MixedPrecision, Strategy
from hsdp.sharding.tp_blocks import local_of, placement_of, unsharded_spec
from hsdp.sharding.write_guard import direct
from hsdp.streams.contract import Event, SideStream
from hsdp.topology.communicators import CommGroups
from hsdp.topology.outer_mode import OuterMode

Slot = tuple[nn.Module, str]



def _alias(storage_of: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """A tensor over part of another's storage with its OWN version counter: writes
    through the base (collectives) do not bump it."""
    return torch.empty(0, dtype=storage_of.dtype, device=storage_of.device).set_(
        storage_of.untyped_storage(), storage_of.storage_offset() + offset, (numel,))



def owner(p: torch.Tensor) -> tuple[ParamGroup, int] | None:
    """(group, index in the group) of a sharded parameter hsdp manages, else None."""
    group = getattr(p, "_hsdp_group", None)
    return None if group is None else (group, p._hsdp_index)



class ParamGroup:
    """The parameters of one unit that share a dtype and requires_grad, flattened; its
    parts ``gather``, ``grads`` (None until a parameter is trainable) and ``state``."""

    def __init__(self, label: str, params: list[nn.Parameter], slots: list[list[Slot]],
                 comms: CommGroups, device: torch.device, strategy: Strategy,
                 mp: MixedPrecision, outer: Sequence[OuterMode] = ()) -> None:
        self.label = label
        self.slots = slots
        self.comms = comms
        self.mp = mp
        self.strategy = strategy
        self.requires_grad = params[0].requires_grad
        self.orig_dtype = params[0].dtype
        self.param_dtype, self.reduce_dtype = mp.resolve(self.orig_dtype)
        f8 = float8_dtype(params[0])  # the group key makes it the same for all
        self.float8 = None if f8 is None else Float8Weights(params, f8)
        gather_dtype = self.param_dtype if f8 is None else f8
        # The flat buffer is sharded over outer too: hfsdp's trainable groups.
        self.shard_outer = strategy.shards_outer and self.requires_grad
        params = self._tp_locals(params)
        self.layout = lay = FlatLayout.build([tuple(p.shape) for p in params],
                                             comms.inner_size, comms.outer_size,
                                             self.shard_outer)
        i, o = comms.inner_rank, comms.outer_rank
        self.inner_lo, _ = lay.inner_range(i)
        owned_lo, owned_hi = lay.owned_range(o, i)
        S, C = lay.shard_numel, lay.chunk_numel
        sources = [p.detach().reshape(-1) for p in params]

        self.main = self._filled(sources, owned_lo, C, self.orig_dtype, device)
        self.inner_shard: torch.Tensor | None = None
        self.chunk_offset = 0
        # The outer modes' state (None: the exact reduction / gather, no DiLoCo).
        self.outer = tuple(outer)
        self.compressed: CompressedOuter | None = None
        self.compressed_gather: CompressedGather | None = None
        self.anchor: Anchor | None = None
        for mode in self.outer:
            mode.attach(self)
        if not self.shard_outer:
            self.ag_src = self.main
        else:
            self.inner_shard = self._filled(sources, self.inner_lo, S, gather_dtype, device)
            self.chunk_offset = owned_lo - self.inner_lo
            if gather_dtype == self.orig_dtype and self.compressed_gather is None:
                # main is a window of the inner shard
                self.main = _alias(self.inner_shard, self.chunk_offset, C)
            self.ag_src = self.inner_shard

        self._make_sharded(owned_lo, owned_hi)
        self._make_unsharded(params, device, gather_dtype)
        self._make_parts()
        # None: gradients are means over the DP ranks; f: sums divided by f (FSDP2's
        # set_gradient_divide_factor; 1.0 gives plain sums).
        self.divide_factor: float | None = None
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # set_all_reduce_hook
        self.on_all_grads: Callable[[ParamGroup], None] | None = None
        self.param_requires_grad = [p.requires_grad for p in params]
        self.grads: GradientState | None = None  # made for the first trainable parameter
        if self.requires_grad:
            self._make_grads()

    def _make_parts(self) -> None:
        """The buffers as the parts receive them; the gathers and the state I/O."""
        self.buffers = GroupBuffers(
            label=self.label, comms=self.comms, layout=self.layout, orig_dtype=self.orig_dtype,
            reduce_dtype=self.reduce_dtype, shard_outer=self.shard_outer, float8=self.float8,
            inner_lo=self.inner_lo, main=self.main, ag_src=self.ag_src,
            inner_shard=self.inner_shard, chunk_offset=self.chunk_offset,
            gathered=self.gathered, gathered_bytes=self._gathered_bytes, sharded=self.sharded,
            unsharded=self.unsharded, slots=self.slots, slices=self._slices,
            shard_starts=self.shard_starts, specs=self.specs,
            tp_specs=self.tp_specs, guard_hooks=self._guard_hooks)
        self.gather = GroupGather(self.buffers, self.compressed_gather)
        if self.float8 is not None and not self.main.is_meta:
            self.float8.scaled_at(self.gather.synced_version)  # scales of the weights as they are
        self.state = GroupIO(self.buffers)

    def _tp_locals(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Mark the original parameters (for ties and stale optimizers) and return what
        hsdp shards of them: their TP-local tensors (see ``tp_blocks.py``). Keeps, per parameter,
        the spec of its gathered DTensor on mesh["tp"] (None: a plain parameter) and the
        TP placement of its shards (None without a tp dim)."""
        for idx, p in enumerate(params):
            p._hsdp_moved_to = (self, idx)
        self.tp_specs = [unsharded_spec(p, self.param_dtype) if isinstance(p, DTensor)
                         else None for p in params]
        self._tp = [placement_of(p) if self.comms.mesh.ndim > 2 else None for p in params]
        self._shapes = [tuple(p.shape) for p in params]  # whole (over TP too)
        return [local_of(p) for p in params]

    def _make_sharded(self, owned_lo: int, owned_hi: int) -> None:
        """Sharded parameters: DTensors over views of ``main``; registered on the
        modules."""
        self.sharded: list[nn.Parameter] = []
        self._slices: list[tuple[int, int]] = []  # (offset in main, length) per parameter
        self._guard_hooks: list[int | None] = []  # id of _grad_on_shard's hook per parameter
        self.shard_starts: list[int] = []  # first element of each parameter held here
        self.specs = [spec(self.comms.mesh, self.shard_outer, shape, self.orig_dtype, tp)
                      for shape, tp in zip(self._shapes, self._tp)]
        if self.anchor is not None and not self.shard_outer and self.comms.outer_rank:
            for s in self.specs:  # DiLoCo: checkpoints hold outer replica 0's values
                save_from_other_replica(s)
        owned = self.layout.pieces(owned_lo, owned_hi)
        # Hooks on the group's own tensors reach it weakly: a strong reference is a cycle
        # through autograd's C++ that gc cannot see (the model, and with it the process
        # groups' threads and sockets, would never be freed).
        me = weakref.ref(self)
        locals_ = placeholders_if_empty([self.main[pc.range_offset:pc.range_offset + pc.length]
                                         if pc else self.main[:0] for pc in owned])
        for dspec, piece, local in zip(self.specs, owned, locals_):
            a, n = (piece.range_offset, piece.length) if piece else (0, 0)
            start = piece.param_start if piece else 0
            sp = nn.Parameter(as_dtensor(local, dspec, start, n),
                              requires_grad=self.requires_grad)
            attach_chunks(sp._local_tensor, dspec, start, n)  # state_dict(keep_vars=True)
            sp._hsdp_group = self  # marks the parameter as managed by hsdp (see owner())
            sp._hsdp_index = len(self.sharded)
            guard = (sp.register_post_accumulate_grad_hook(
                         lambda p: me()._grad_on_shard(p))
                     if self.requires_grad else None)
            self._guard_hooks.append(None if guard is None else guard.id)
            self.sharded.append(sp)
            self._slices.append((a, n))
            self.shard_starts.append(start)

    def _make_unsharded(self, params: list[nn.Parameter], device: torch.device,
                        dtype: torch.dtype) -> None:
        """Unsharded parameters: windows of the gathered buffer, whose storage comes
        and goes; own version counters, so re-gathering for backward does not look like
        an in-place change to autograd's saved tensors. Float8: torchao's float8
        tensors over the windows; a TP parameter: a DTensor on mesh["tp"] again."""
        self.gathered = torch.empty(self.layout.total, dtype=dtype, device=device)
        views = [_alias(self.gathered, off, p.numel()).view(p.shape)
                 for p, off in zip(params, self.layout.offsets)]
        self.unsharded = (
            [nn.Parameter(v if s is None else DTensor(v, s, requires_grad=False),
                          requires_grad=self.requires_grad)
             for v, s in zip(views, self.tp_specs)]
            if self.float8 is None else
            self.float8.unsharded(views, self.param_dtype, self.requires_grad))
        self._gathered_bytes = self.layout.total * self.gathered.element_size()
        self.gathered.untyped_storage().resize_(0)

    @property
    def has_grads(self) -> bool:
        """Gradient state (buffers, hooks) made: trainable now or earlier."""
        return self.grads is not None

    def _make_grads(self) -> None:
        me = weakref.ref(self)  # see _make_sharded
        self.grads = GradientState(self.buffers, self.compressed,
                                   sum(self.param_requires_grad),
                                   lambda: me()._all_grads_in(),
                                   all(m.reduces_every_step for m in self.outer))
        self.grads.set_all_reduce_hook(self.all_reduce_hook)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None) -> None:
        """FSDP2's ``set_all_reduce_hook`` for this group: its gradient state runs ``hook``
        on the outer all-reduce's result (kept here for gradient state made later)."""
        self.all_reduce_hook = hook
        if self.grads is not None:
            self.grads.set_all_reduce_hook(hook)

    def _all_grads_in(self) -> None:
        if self.on_all_grads is not None:
            self.on_all_grads(self)

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad_`` changes made on the sharded parameters since
        fully_shard (FSDP2 does the same at each unshard): a frozen parameter gets no
        gradient, no reduction and no update; a group with none trainable is not reduced."""
        with direct():
            now = [p.requires_grad for p in self.sharded]
        if now == self.param_requires_grad:
            return
        if any(now) and not self.has_grads:
            if self.strategy.shards_outer:
                module, name = self.slots[now.index(True)][0]
                raise RuntimeError(
                    f"hsdp: {type(module).__name__}.{name} was frozen when fully_shard ran; "
                    f"with strategy='hfsdp' its shards cannot become trainable later (they "
                    f"are not sharded over outer). Set requires_grad before fully_shard.")
            self._make_grads()
        for up, flag in zip(self.unsharded, now):
            up.requires_grad_(flag)
        self.param_requires_grad = now
        if self.grads is not None:
            self.grads.set_trainable(sum(now))
        self.requires_grad = any(now)

    def _grad_on_shard(self, p: nn.Parameter) -> None:
        """Autograd reached a sharded parameter: it was used outside its unit's forward
        (e.g. through ``to_local()`` in a loss term), where its gradient would be lost."""
        module, name = self.slots[p._hsdp_index][0]
        raise RuntimeError(
            f"hsdp: a gradient reached the sharded {type(module).__name__}.{name} (group "
            f"{self.label}) directly: it was used outside the forward of the unit that owns "
            f"it, where hsdp would lose that gradient. Use it inside that unit's forward, or "
            f"fully_shard the module that uses it together with it (their common parent).")

    @property
    def divisor(self) -> float | None:
        """What the gradient sums are divided by: the divide factor (None: the collectives
        average). On an expert mesh the mean is over outer x inner x ep ranks, which no
        collective's average gives: an explicit division by that count."""
        if self.divide_factor is None and self.comms.ep_size > 1:
            return float(self.comms.mean_ranks)
        return self.divide_factor

    def reduce_scatter(self, stream: SideStream, coll: Collectives, rs_in: torch.Tensor,
                       first: bool, after: Sequence[Event], outer_next: bool = False) -> Event:
        """The gradient state's inner reduce-scatter, divided by this group's divisor."""
        return self.grads.reduce_scatter(stream, coll, rs_in, first, after, self.divisor,
                                         outer_next)

    def reduce_outer(self, stream: SideStream, coll: Collectives,
                     after: Sequence[Event]) -> Event:
        """The gradient state's outer reduction, divided by this group's divisor."""
        return self.grads.reduce_outer(stream, coll, after, self.divisor)

    def load_flat(self, flat: torch.Tensor) -> None:
        """Take this rank's shards (and float8 scales) from ``flat``, the whole group in the
        original dtype (``GroupIO.load_flat``); the inner shard is then up to date."""
        self.state.load_flat(flat)
        self.gather.mark_synced()

    def _filled(self, sources: list[torch.Tensor], lo: int, numel: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """``numel`` elements of the flat layout starting at ``lo``, padding zeroed (and
        where the source is on the meta device: no values yet); float8: cast with the
        weights' scales."""
        out = torch.zeros(numel, dtype=dtype, device=device)
        if self.float8 is not None and dtype == self.float8.dtype:
            if any(src.is_meta for src in sources):  # no values, no scales yet
                return out
            self.float8.cast(out, self._filled(sources, lo, numel, self.orig_dtype, device),
                             self.layout.pieces(lo, lo + numel))
            return out
        for src, pc in zip(sources, self.layout.pieces(lo, lo + numel)):
            if pc is not None and not src.is_meta:
                out[pc.range_offset:pc.range_offset + pc.length].copy_(
                    src[pc.param_start:pc.param_start + pc.length])
        return out

    def use_unsharded(self) -> None:
        if self.float8 is not None:
            self.float8.show(self.unsharded, self.param_dtype)
        for slots, p in zip(self.slots, self.unsharded):
            for module, name in slots:
                module._parameters[name] = p

    def use_sharded(self) -> None:
        for slots, p in zip(self.slots, self.sharded):
            for module, name in slots:
                module._parameters[name] = p
