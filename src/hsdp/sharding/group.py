"""One unit's parameter group: flat buffers, sharded / unsharded views, its collectives.

A group holds the parameters of one unit that share a dtype and requires_grad. Its
collectives are in ``group_comm.py`` (HOW to gather, reduce and swap one group;
``runtime/schedule.py`` decides WHEN, on which stream and after which events), its
gradient state in ``grad_state.py``, its state I/O in ``group_state.py``.

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
- ``accum``      [S] original dtype: the inner reduce-scatter accumulates microbatches here;
                 hsdp's outer all-reduce runs on it in place, so it is also hsdp's grad.
- ``grad_buf``   [C]: hfsdp's outer reduce-scatter output (hsdp: ``accum``).
With ``outer_reduce`` the outer reduction is compressed (``compressed.py``), which keeps
an fp32 error-feedback residual of about S elements per group. With DiLoCo
(``init_mesh(outer_sync=...)``) there is no outer reduction per step; ``anchor.py`` keeps
an fp32 anchor (and momentum) of C elements.
``accum`` and ``grad_buf`` exist from the step's first reduce-scatter until the user has
cleared the gradients (``zero_grad``) and the next step starts: allocated by the stream
that first writes them, freed by ``release_grads``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hsdp.sharding.anchor import Anchor
from hsdp.sharding.chunks import attach_chunks
from hsdp.sharding.compressed import CompressedOuter
from hsdp.sharding.float8_weights import Float8Weights, float8_dtype
from hsdp.sharding.grad_state import GradientState
from hsdp.sharding.group_comm import GroupCollectives
from hsdp.sharding.group_state_dict import GroupState
from hsdp.sharding.layout import FlatLayout
from hsdp.sharding.pieces import as_dtensor, placeholders_if_empty, spec
from hsdp.sharding.policy import MixedPrecision, OuterReduce, Strategy
from hsdp.sharding.tp_blocks import block_of, local_of, placement_of, unsharded_spec
from hsdp.streams.contract import Event
from hsdp.topology.communicators import CommGroups

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



class ParamGroup(GradientState, GroupCollectives, GroupState):
    """The parameters of one unit that share a dtype and requires_grad, flattened."""

    def __init__(self, label: str, params: list[nn.Parameter], slots: list[list[Slot]],
                 comms: CommGroups, device: torch.device, strategy: Strategy,
                 mp: MixedPrecision, outer_reduce: OuterReduce | None = None) -> None:
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
        if not self.shard_outer:
            self.ag_src = self.main
        else:
            self.inner_shard = self._filled(sources, self.inner_lo, S, gather_dtype, device)
            self.chunk_offset = owned_lo - self.inner_lo
            if gather_dtype == self.orig_dtype:  # main is a window of the inner shard
                self.main = _alias(self.inner_shard, self.chunk_offset, C)
            self.ag_src = self.inner_shard

        self.outer_config = outer_reduce
        # The compressed outer reduction and its residual (None: the exact one).
        self.compressed = (CompressedOuter(outer_reduce, S, comms.outer_size, o, device)
                           if outer_reduce is not None and comms.outer_size > 1 else None)
        # DiLoCo (init_mesh(outer_sync=...)): the anchor and outer momentum of main.
        self.anchor = (Anchor(comms.outer_sync)
                       if comms.outer_sync is not None and self.requires_grad else None)
        self._make_sharded(owned_lo, owned_hi)
        self.synced_version: int | None = self.version()
        if self.float8 is not None and not self.main.is_meta:
            self.float8.version = self.synced_version  # scales of the weights as they are
        self._make_unsharded(params, device, gather_dtype)

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

    def _tp_locals(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Mark the original parameters (for ties and stale optimizers) and return what
        hsdp shards of them: their TP-local tensors (see ``tp.py``). Keeps, per parameter,
        the spec of its gathered DTensor on mesh["tp"] (None: a plain parameter) and the
        TP placement of its shards (None without a tp dim)."""
        for idx, p in enumerate(params):
            p._hsdp_moved_to = (self, idx)
        self.tp_specs = [unsharded_spec(p, self.param_dtype) if isinstance(p, DTensor)
                         else None for p in params]
        self._tp = [placement_of(p) if self.comms.tp_size > 1 else None for p in params]
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
        self._groups_of = [self.comms.piece_groups(self.shard_outer, block_of(s) is not None)
                           for s in self.specs]
        owned = self.layout.pieces(owned_lo, owned_hi)
        # Hooks on the group's own tensors reach it weakly: a strong reference is a cycle
        # through autograd's C++ that gc cannot see (the model, and with it the process
        # groups' threads and sockets, would never be freed).
        me = weakref.ref(self)
        locals_ = placeholders_if_empty([self.main[pc.range_offset:pc.range_offset + pc.length]
                                         if pc else self.main[:0] for pc in owned])
        for dspec, piece, local, groups in zip(self.specs, owned, locals_, self._groups_of):
            a, n = (piece.range_offset, piece.length) if piece else (0, 0)
            start = piece.param_start if piece else 0
            sp = nn.Parameter(as_dtensor(local, dspec, start, n, groups),
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

    def version(self) -> int:
        """Changes when the sharded values were written through ``main`` (checkpoint
        loading) or by a non-foreach in-place op on a DTensor parameter (which bumps the
        parameter's own counter). Foreach ops on DTensors bump nothing: the optimizer
        step hook calls ``mark_written`` instead."""
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
        return [self.main[a:a + n] for a, n in self._slices]

    def mark_written(self) -> None:
        """hfsdp: the next refresh re-gathers the inner shard from every updated chunk."""
        self.synced_version = None

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
