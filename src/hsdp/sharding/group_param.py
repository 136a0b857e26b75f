"""``GroupParam``: one parameter of a parameter group (FSDP2's ``FSDPParam``): where the
modules show it, its sharded and unsharded forms, where this rank's piece of it lies
in the group's ``main`` buffer; ``group_build.py`` makes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from hsdp.sharding.pieces import Piece, checkpoint_view
from hsdp.sharding.tp_blocks import block_of

Slot = tuple[nn.Module, str]


@dataclass(eq=False)
class GroupParam:
    """Parameter ``index`` of its group."""

    index: int
    slots: list[Slot]  # where modules show it (several: tied)
    sharded: nn.Parameter  # a DTensor over ``local`` (a placeholder where that is empty)
    unsharded: nn.Parameter  # a view of the group's gathered buffer
    local: torch.Tensor  # this rank's piece: a 1-D view of ``main`` (possibly empty)
    offset: int  # where ``local`` starts in ``main``
    start: int  # its first element in the flattened parameter (or TP block)
    spec: DTensorSpec  # the sharded DTensor's spec
    tp_spec: DTensorSpec | None  # the gathered DTensor's spec on mesh["tp"] (None: plain)
    guard_hook: int | None  # id of hsdp's own grad hook on ``sharded`` (``_grad_on_shard``)
    requires_grad: bool  # as last followed (``ParamGroup.sync_requires_grad``)

    @property
    def length(self) -> int:
        """Elements of it held on this rank."""
        return self.local.numel()

    @property
    def name(self) -> str:
        """``Module.name`` of its first slot, for error messages."""
        module, name = self.slots[0]
        return f"{type(module).__name__}.{name}"

    def piece_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of it in ``full``, the whole parameter (of the global shape:
        its TP block first, where TP shards it)."""
        block = block_of(self.spec)
        flat = (full if block is None else block.local_of(full)).reshape(-1)
        return flat[self.start:self.start + self.length]

    def checkpoint_view(self, local: torch.Tensor | None = None) -> Piece:
        """A DTensor for state dicts over ``local`` (by default its own piece), which must
        be laid out like that piece (e.g. its optimizer state)."""
        return checkpoint_view(self.sharded, self.local if local is None else local)

    def follow(self, requires_grad: bool) -> None:
        """The sharded parameter's ``requires_grad`` changed: the unsharded one follows."""
        self.unsharded.requires_grad_(requires_grad)
        self.requires_grad = requires_grad
