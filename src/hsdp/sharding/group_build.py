"""Building a parameter group's buffers (``GroupBuffers``) from its parameters, in two
steps: the flat layout and ``main`` (what the outer modes attach their state to), then
hfsdp's inner shard, the gathered buffer and each parameter's sharded and unsharded
forms (``GroupParam``)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hsdp.sharding.chunks import attach_chunks, save_from_other_replica
from hsdp.sharding.float8_weights import Float8Weights, float8_dtype
from hsdp.sharding.group_buffers import GroupBuffers
from hsdp.sharding.group_param import GroupParam, Slot
from hsdp.sharding.layout import FlatLayout
from hsdp.sharding.pieces import as_dtensor, placeholders_if_empty, spec
from hsdp.sharding.tp_blocks import local_of, placement_of, unsharded_spec
from hsdp.topology.communicators import CommGroups


def _alias(storage_of: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """A tensor over part of another's storage with its OWN version counter: writes
    through the base (collectives) do not bump it."""
    return torch.empty(0, dtype=storage_of.dtype, device=storage_of.device).set_(
        storage_of.untyped_storage(), storage_of.storage_offset() + offset, (numel,))


class GroupBuild:
    """The buffers of ``owner`` (a ``ParamGroup``: its parameters are marked as its, and
    its guard hooks reach it weakly) over ``params``, which share a dtype and
    requires_grad; ``dtypes``: (original, parameter, reduce)."""

    def __init__(self, owner: Any, label: str, params: list[nn.Parameter],
                 slots: list[list[Slot]], comms: CommGroups, device: torch.device,
                 shard_outer: bool, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
                 ) -> None:
        self.owner, self.label, self.slots, self.comms = owner, label, slots, comms
        self.device, self.shard_outer = device, shard_outer
        self.orig_dtype, self.param_dtype, self.reduce_dtype = dtypes
        self.requires_grad = params[0].requires_grad
        f8 = float8_dtype(params[0])  # the group key makes it the same for all
        self.float8 = None if f8 is None else Float8Weights(params, f8)
        self.gather_dtype = self.param_dtype if f8 is None else f8
        self.locals = self._tp_locals(params)
        self.layout = lay = FlatLayout.build([tuple(p.shape) for p in self.locals],
                                             comms.inner_size, comms.outer_size, shard_outer)
        self.inner_lo, _ = lay.inner_range(comms.inner_rank)
        self.owned = lay.owned_range(comms.outer_rank, comms.inner_rank)
        self.sources = [p.detach().reshape(-1) for p in self.locals]
        self.main = self._filled(self.owned[0], lay.chunk_numel, self.orig_dtype)

    def _tp_locals(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Mark the original parameters (for ties and stale optimizers) and return what
        hsdp shards of them: their TP-local tensors (see ``tp_blocks.py``). Keeps, per
        parameter, the spec of its gathered DTensor on mesh["tp"] (None: a plain
        parameter) and the TP placement of its shards (None without a tp dim)."""
        for idx, p in enumerate(params):
            p._hsdp_moved_to = (self.owner, idx)
        self.tp_specs = [unsharded_spec(p, self.param_dtype) if isinstance(p, DTensor)
                         else None for p in params]
        self.tp = [placement_of(p) if self.comms.mesh.ndim > 2 else None for p in params]
        self.shapes = [tuple(p.shape) for p in params]  # whole (over TP too)
        return [local_of(p) for p in params]

    def _filled(self, lo: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of the flat layout starting at ``lo``, padding zeroed (and
        where the source is on the meta device: no values yet); float8: cast with the
        weights' scales."""
        out = torch.zeros(numel, dtype=dtype, device=self.device)
        if self.float8 is not None and dtype == self.float8.dtype:
            if any(src.is_meta for src in self.sources):  # no values, no scales yet
                return out
            self.float8.cast(out, self._filled(lo, numel, self.orig_dtype),
                             self.layout.pieces(lo, lo + numel))
            return out
        for src, pc in zip(self.sources, self.layout.pieces(lo, lo + numel)):
            if pc is not None and not src.is_meta:
                out[pc.range_offset:pc.range_offset + pc.length].copy_(
                    src[pc.param_start:pc.param_start + pc.length])
        return out

    def flat(self) -> GroupBuffers:
        """The layout and ``main`` alone (no views yet): what the outer modes attach to."""
        return self._buffers(main=self.main, ag_src=self.main)

    def _buffers(self, **tensors: Any) -> GroupBuffers:
        return GroupBuffers(
            label=self.label, comms=self.comms, layout=self.layout,
            orig_dtype=self.orig_dtype, reduce_dtype=self.reduce_dtype,
            shard_outer=self.shard_outer, float8=self.float8, inner_lo=self.inner_lo,
            **tensors)

    def finish(self, own_main: bool, replica0: bool) -> GroupBuffers:
        """The whole buffers. ``own_main``: ``main`` keeps its own storage even where it
        could be a window of hfsdp's inner shard (a compressed outer all-gather: the inner
        shard holds dequantized weights); ``replica0``: checkpoints hold outer replica 0's
        values of the shards (DiLoCo, replicated over outer)."""
        main, inner, offset = self.main, None, 0
        C, S = self.layout.chunk_numel, self.layout.shard_numel
        if self.shard_outer:
            inner = self._filled(self.inner_lo, S, self.gather_dtype)
            offset = self.owned[0] - self.inner_lo
            if self.gather_dtype == self.orig_dtype and not own_main:
                main = _alias(inner, offset, C)  # main is a window of the inner shard
        gathered, unsharded = self._unsharded()
        params = self._params(main, unsharded, replica0)
        return self._buffers(main=main, ag_src=main if inner is None else inner,
                             inner_shard=inner, chunk_offset=offset, gathered=gathered,
                             gathered_bytes=self.layout.total * gathered.element_size(),
                             params=params)

    def _params(self, main: torch.Tensor, unsharded: list[nn.Parameter], replica0: bool
                ) -> list[GroupParam]:
        """Each parameter: its sharded DTensor over a view of ``main``, registered on the
        modules, with hsdp's guard hook (trainable groups)."""
        specs = [spec(self.comms.mesh, self.shard_outer, shape, self.orig_dtype, tp)
                 for shape, tp in zip(self.shapes, self.tp)]
        if replica0:
            for s in specs:
                save_from_other_replica(s)
        owned = self.layout.pieces(*self.owned)
        # Hooks on the group's own tensors reach it weakly: a strong reference is a cycle
        # through autograd's C++ that gc cannot see (the model, and with it the process
        # groups' threads and sockets, would never be freed).
        me = weakref.ref(self.owner)
        ranges = [(pc.range_offset, pc.length, pc.param_start) if pc else (0, 0, 0)
                  for pc in owned]
        locals_ = placeholders_if_empty([main[a:a + n] for a, n, _ in ranges])
        out = []
        for idx, (dspec, (a, n, start), local) in enumerate(zip(specs, ranges, locals_)):
            sp = nn.Parameter(as_dtensor(local, dspec, start, n),
                              requires_grad=self.requires_grad)
            attach_chunks(sp._local_tensor, dspec, start, n)  # state_dict(keep_vars=True)
            sp._hsdp_group = self.owner  # marks the parameter as managed by hsdp (owner())
            sp._hsdp_index = idx
            guard = (sp.register_post_accumulate_grad_hook(lambda p: me()._grad_on_shard(p))
                     if self.requires_grad else None)
            out.append(GroupParam(
                index=idx, slots=self.slots[idx], sharded=sp, unsharded=unsharded[idx],
                local=main[a:a + n], offset=a, start=start, spec=dspec,
                tp_spec=self.tp_specs[idx], guard_hook=None if guard is None else guard.id,
                requires_grad=self.locals[idx].requires_grad))
        return out

    def _unsharded(self) -> tuple[torch.Tensor, list[nn.Parameter]]:
        """The gathered buffer and the unsharded parameters: windows of it, whose storage
        comes and goes; own version counters, so re-gathering for backward does not look
        like an in-place change to autograd's saved tensors. Float8: torchao's float8
        tensors over the windows; a TP parameter: a DTensor on mesh["tp"] again."""
        gathered = torch.empty(self.layout.total, dtype=self.gather_dtype, device=self.device)
        views = [_alias(gathered, off, p.numel()).view(p.shape)
                 for p, off in zip(self.locals, self.layout.offsets)]
        unsharded = (
            [nn.Parameter(v if s is None else DTensor(v, s, requires_grad=False),
                          requires_grad=self.requires_grad)
             for v, s in zip(views, self.tp_specs)]
            if self.float8 is None else
            self.float8.unsharded(views, self.param_dtype, self.requires_grad))
        gathered.untyped_storage().resize_(0)
        return gathered, unsharded
