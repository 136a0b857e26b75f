"""Meta-device initialization: ``materialize`` gives a model that was built on the meta
device and then ``fully_shard``-ed its shards on the mesh's device, running the user's
init once per module.

Each rank runs the same ``init_fn`` on the same full values under the same seed, so each
can keep its own shards without any communication. When the walk over ``model.modules()``
reaches a unit, its groups are rebuilt on the mesh's device (shards allocated, no values)
and a flat buffer of the unit's full values is made in the parameters' own dtype; views of
it are ``m``'s parameters while ``init_fn(m)`` runs; when the walk leaves the unit, each
rank copies its shards out of it and frees it. So full values exist for the root (whose
modules usually come first and last) and one other unit at a time. A unit reached again
later starts from its shards, all-gathered (the only communication).

A tensor-parallel parameter (a DTensor on ``mesh["tp"]``) is shown to ``init_fn`` whole,
as a plain tensor of its global shape: each rank initializes all of it (the same values on
every rank) and keeps its TP block, so the result equals the model initialized without TP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from hsdp.runtime.hooks import units_below
from hsdp.runtime.unit import Unit
from hsdp.sharding.comm import Collectives
from hsdp.sharding.group import ParamGroup, owner
from hsdp.sharding.tp_blocks import block_of, meta_like


@torch.no_grad()
def materialize(model: nn.Module, init_fn: Callable[[nn.Module], None]) -> None:
    """Allocate the shards of ``model`` (the root passed to ``fully_shard``) on the mesh's
    device and initialize them: ``init_fn(m)`` runs once for every ``m`` in
    ``model.modules()`` order, with ``m``'s own parameters and buffers present in full,
    and must initialize every parameter and buffer that was on the meta device (as after
    ``to_empty``). The result equals ``for m in model.modules(): init_fn(m)`` on the
    same model built normally, under the same random seed. Call it before the first
    forward and before building the optimizer; every rank must call it."""
    root = getattr(model, "_hsdp_unit", None)
    if root is None:
        raise ValueError("hsdp.materialize: expected the root module passed to "
                         "hsdp.fully_shard")
    units = list(units_below(model))
    if any(u.runtime is not None for u in units):
        raise RuntimeError("hsdp.materialize: the model has already run; materialize it "
                           "before its first forward")
    walk = _Walk(root, units)
    for m in model.modules():
        walk.visit(m, init_fn)
    walk.close_all()
    missing = walk.unwritten()
    if missing:
        raise RuntimeError(f"hsdp.materialize: init_fn left these meta tensors "
                           f"uninitialized: {', '.join(missing)}")


class _Walk:
    """Full values of the open units' groups, and which meta tensors were initialized."""

    def __init__(self, root: Unit, units: list[Unit]) -> None:
        self.root = root
        self.units = units
        self.unit_of = {g: u for u in units for g in u.groups}
        self.flats: dict[ParamGroup, torch.Tensor] = {}  # open groups' full values
        self.open_units: list[Unit] = []
        self.fresh: list[ParamGroup] = []  # allocated here (were on meta)
        self.written: set[tuple[ParamGroup, int]] = set()  # fresh parameters initialized
        self.paths = {id(m): path for path, m in root.module.named_modules()}
        self.pending_buffers: dict[tuple[int, str], str] = {}
        self.blank: set[ParamGroup] = set()  # open groups whose full values are unset

    # ------------------------------------------------------------------ units

    def _open(self, unit: Unit) -> None:
        for g in list(unit.groups):
            if g.main.is_meta:  # allocate the shards (no data yet), then the full values
                metas = [nn.Parameter(meta_like(shape, g.orig_dtype, q.tp_spec),
                                      requires_grad=q.sharded.requires_grad)
                         for shape, q in zip(g.layout.shapes, g.params)]
                if g.float8 is not None:  # still gathered in float8
                    metas = g.float8.wrap(metas)
                old, g = g, ParamGroup(g.label, metas, [q.slots for q in g.params], g.comms,
                                       unit.device, g.strategy, g.mp, g.outer)
                self._replace(old, g)
                self.fresh.append(g)
                fill = float("nan") if g.orig_dtype.is_floating_point else 0
                flat = torch.full((g.layout.total,), fill, dtype=g.orig_dtype,
                                  device=unit.device)
                for a, b in g.layout.gaps():
                    flat[a:b] = 0
                self.flats[g] = flat
                self.blank.add(g)
            else:  # allocated already: start from its current values (a collective)
                self.flats[g] = g.full_flat(Collectives())
        self.open_units.append(unit)

    def _replace(self, old: ParamGroup, new: ParamGroup) -> None:
        """Put ``new`` wherever ``old`` was: its unit, the units that use it (ties), the
        module slots that show its parameters."""
        unit = self.unit_of[old]
        unit.groups[unit.groups.index(old)] = new
        self.unit_of[new] = unit
        new.use_sharded()
        new.divide_factor = old.divide_factor
        for u in self.units:
            u.uses = [new if g is old else g for g in u.uses]
            u.borrowed = [(new if g is old else g, idx, slot) for g, idx, slot in u.borrowed]
            for g, idx, (module, name) in u.borrowed:
                if g is new:
                    module._parameters[name] = new.params[idx].sharded

    def _close(self, unit: Unit) -> None:
        for g in unit.groups:
            g.load_flat(self.flats.pop(g))
            self.blank.discard(g)
        self.open_units.remove(unit)

    def close_all(self) -> None:
        for unit in list(self.open_units):
            self._close(unit)

    # ------------------------------------------------------------------ modules

    def visit(self, m: nn.Module, init_fn: Callable[[nn.Module], None]) -> None:
        names = [n for n, p in m._parameters.items() if p is not None]
        if any(owner(m._parameters[n]) is None for n in names):
            raise RuntimeError(f"hsdp.materialize: {type(m).__name__} has parameters no "
                               f"fully_shard unit manages; fully_shard the root module")
        needed: list[Unit] = []  # in parameter order: the same on every rank
        for n in names:
            unit = self.unit_of[owner(m._parameters[n])[0]]
            if unit not in needed:
                needed.append(unit)
        for unit in list(self.open_units):  # at most the root and the units m needs
            if unit is not self.root and unit not in needed:
                self._close(unit)
        for unit in needed:
            if unit not in self.open_units:
                self._open(unit)

        own = {n: owner(m._parameters[n]) for n in names}  # groups opened may be new
        shown = {}
        for n, (g, idx) in own.items():
            shown[n] = m._parameters[n] = nn.Parameter(
                self._whole(g, idx), requires_grad=g.params[idx].sharded.requires_grad)
        versions = {n: p._version for n, p in shown.items()}
        buffers = {}
        for n, b in m._buffers.items():
            if b is not None and b.is_meta:
                buffers[n] = m._buffers[n] = torch.empty_like(b, device=self.root.device)
                path = self.paths.get(id(m), "")
                self.pending_buffers[(id(m), n)] = f"{path}.{n}" if path else n
        buf_versions = {n: b._version for n, b in buffers.items()}

        init_fn(m)

        for n, (g, idx) in own.items():
            now = m._parameters[n]
            if now is not shown[n]:  # init_fn assigned a new parameter: take its values
                shown[n].copy_(now)
            if now is not shown[n] or shown[n]._version != versions[n]:
                self.written.add((g, idx))
                block = block_of(g.params[idx].spec)
                if block is not None:  # keep this rank's TP block of the whole value
                    self._view(g, idx).copy_(block.local_of(shown[n]))
            m._parameters[n] = g.params[idx].sharded
        for n, b in buffers.items():
            if m._buffers[n] is not b or b._version != buf_versions[n]:
                self.pending_buffers.pop((id(m), n))

    def _view(self, g: ParamGroup, idx: int) -> torch.Tensor:
        """Parameter ``idx`` of open group ``g`` in its full values (TP-local shape)."""
        off, numel = g.layout.offsets[idx], g.layout.numels[idx]
        return self.flats[g][off:off + numel].view(g.layout.shapes[idx])

    def _whole(self, g: ParamGroup, idx: int) -> torch.Tensor:
        """What ``init_fn`` sees of parameter ``idx``: its view in the full values, or,
        where TP shards it, a tensor of its global shape (gathered over the tp ranks
        unless the group has no values yet)."""
        view = self._view(g, idx)
        block = block_of(g.params[idx].spec)
        if block is None:
            return view
        if g in self.blank:
            return torch.empty(block.shape, dtype=view.dtype, device=view.device)
        return block.whole(view, g.comms.host_tp)

    def unwritten(self) -> list[str]:
        names = []
        for g in self.fresh:
            for q in g.params:
                if (g, q.index) not in self.written:
                    module, attr = q.slots[0]
                    path = self.paths.get(id(module), "")
                    names.append(f"{path}.{attr}" if path else attr)
        return names + sorted(self.pending_buffers.values())
