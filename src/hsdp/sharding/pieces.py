"""This rank's piece of a parameter as a DTensor over hsdp's 2-D mesh ("uneven DTensor").

Each sharded parameter (and its gradient and optimizer state) is a DTensor whose global
shape is the original parameter's and whose local tensor is the zero-copy 1-D view of this
rank's contiguous range of the flattened parameter inside the flat buffer. Placements:
``(Replicate(), Shard(0))`` on ("outer", "inner") when replicated over outer (hsdp),
``(Shard(0), Shard(0))`` when sharded over both (hfsdp). Why a DTensor: torch's
``clip_grad_norm_``, the optimizers and DCP then see sharded tensors (norms reduce over
the shard dims, elementwise optimizer math runs on the local views). Why "uneven": the
piece is a flat range, not ``torch.chunk`` rows, so the local tensor does not have the
shape DTensor's placements would imply. Elementwise ops do not care (their results stay
Pieces); reductions over every element are computed here from the elements each rank
holds (DTensor's own would count the placeholders of empty pieces and weigh uneven pieces
as even ones), and ops that depend on where elements lie are refused. DCP gets the true
layout from the chunk hooks attached to the local tensor (a flat range of an
N-D tensor is a union of row-major boxes, see ``layout.boxes``), so its default planners
save and reshard it. Redistributing such a tensor the way torch does would misread the
pieces: they are ``Piece``s, whose ``full_tensor()`` assembles them and whose
``redistribute`` refuses anything but replicated placements.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from hsdp.sharding.chunks import Chunks, attach_chunks, writes
from hsdp.sharding.local_ops import ELEMENTWISE, READS, on_locals
from hsdp.sharding.reductions import DECLINED, SPECIAL, note_mixed, special
from hsdp.sharding.tp_blocks import block_of
from hsdp.sharding.write_guard import (
    DATA,
    PENDING,
    any_requires_grad,
    before_write,
    direct,
    written,
)
from hsdp.topology.communicators import registered_groups


def placements(shard_outer: bool, tp: Placement | None = None) -> tuple:
    """Over ("outer", "inner") and, on a 3-D mesh, the parameter's TP placement ``tp``."""
    dp = (Shard(0) if shard_outer else Replicate(), Shard(0))
    return dp if tp is None else (*dp, tp)


def spec(mesh: DeviceMesh, shard_outer: bool, shape: tuple[int, ...],
         dtype: torch.dtype, tp: Placement | None = None) -> DTensorSpec:
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, placements(shard_outer, tp),
                       tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


_DISABLED = torch._C._disabled_torch_function_impl
_GRAD, _IS_SPARSE = torch._C.TensorBase.grad, torch._C.TensorBase.is_sparse


def _laid_out_like(t: DTensor, local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A new result ``local`` of an elementwise op on ``t``: a Piece where ``t`` is one."""
    return piece_like(t, local) if isinstance(t, Piece) else DTensor(local, spec,
                                                                    requires_grad=False)


def _as_piece(out: DTensor, arg: object) -> DTensor:
    """``out``, a DTensor that torch computed from ``arg``, as a Piece where it was computed
    elementwise from one (a clone, p - 1, p.abs(), p == 0), so that what is computed from
    it next knows where its elements lie."""
    if isinstance(arg, Piece) and not out.requires_grad and same_layout(out, arg):
        return as_dtensor(out._local_tensor, out._spec, *arg._hsdp_range)
    return out


class Piece(DTensor):
    """A DTensor over one of hsdp's flat pieces: what parameters, their ``.grad`` and
    state-dict views are. ``full_tensor()`` assembles the pieces (a collective over the
    mesh, host groups); ``redistribute`` to replicated placements goes through it, any other
    is refused (torch's redistribution assumes ``torch.chunk`` rows and would misread
    the pieces). Elementwise foreach ops on Pieces return Pieces (``local_ops.on_locals``), other
    ops plain DTensors (torch's dispatch)."""

    _hsdp_range: tuple[int, int]  # (start, length) in the flattened TP-local tensor

    @property
    def _hsdp_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The host groups whose sum assembles the pieces: inner, outer (hfsdp), tp (a
        TP-sharded parameter). Looked up from the mesh, never kept on the tensor: torch's
        async checkpoint stager deep-copies a tensor's attributes, and its process-based
        saver pickles them, which no process group survives."""
        groups = registered_groups(self._spec.mesh)
        if groups is None:
            raise RuntimeError(
                "hsdp: this hsdp shard (a DTensor of a model sharded by hsdp, unpickled or "
                "copied) needs hsdp's mesh with the same ranks in this process to combine "
                "its pieces (hsdp.init_mesh, then fully_shard); for tensors that load "
                "anywhere save hsdp.full_state_dict(model)")
        return groups.piece_groups(self._spec.placements[0].is_shard(),
                                   block_of(self._spec) is not None)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Optimizer math on pieces: run on the local tensors directly (no per-tensor
        # re-wrapping into base DTensors and sharding propagation, which made torch's
        # foreach AdamW several times slower on DTensors than on plain tensors). Why here
        # and not in ``__torch_dispatch__``: torch 2.11's DTensor dispatches in C++ and
        # never calls a subclass's ``__torch_dispatch__``. Every other op goes on as on a
        # DTensor (which disables ``__torch_function__``).
        # Not where autograd is involved (optimizers run under no_grad): an op on a tensor
        # that requires grad must meet autograd's checks and recording, which the local
        # op would skip.
        kwargs = kwargs or {}
        if func not in READS:  # (a read writes nothing and is none of the ops below)
            if getattr(func, "__self__", None) is DATA:
                group = getattr(args[0], "_hsdp_group", None)
                if group is not None:  # writes through .data bump no version counter
                    group.mark_written()
            if PENDING.data:  # (``len(PENDING)`` is a Python call)
                before_write(written(func, args, kwargs))
            if func in ELEMENTWISE and not (torch.is_grad_enabled() and any_requires_grad(
                    (*args, *kwargs.values()))):
                out = on_locals(func, args, kwargs, _laid_out_like)
                if out is not DECLINED:
                    return out
            kind = SPECIAL.get(func)
            if kind is not None:
                out = special(cls, kind, args, kwargs)
                if out is not DECLINED:
                    return out
        try:
            out = _DISABLED(func, types, args, kwargs)
        except RuntimeError as e:  # e.g. a shard met a plain tensor outside its forward
            note_mixed(e)
            raise
        return _as_piece(out, args[0]) if type(out) is DTensor and args else out

    # ``p.grad`` and ``g.is_sparse`` as torch's getters, without the ``__torch_function__``
    # call each access of a Piece's would make (about 1 us; an optimizer makes several
    # per parameter and step): these properties are found first and read torch's getter
    # with the subclass's ``__torch_function__`` disabled, as that call ends by doing.
    @property
    def grad(self) -> torch.Tensor | None:
        out = _DISABLED(_GRAD.__get__, (), (self,), {})
        return _as_piece(out, self) if type(out) is DTensor else out

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _DISABLED(_GRAD.__set__, (), (self, value), {})

    @grad.deleter
    def grad(self) -> None:
        _DISABLED(_GRAD.__delete__, (), (self,), {})

    @property
    def is_sparse(self) -> bool:
        return _DISABLED(_IS_SPARSE.__get__, (), (self,), {})

    def detach(self) -> Piece:  # nn.Parameter requires detach() to keep the type
        return piece_like(self, self._local_tensor.detach())

    # torch's async checkpoint stager (``dcp.async_save``) copies a tensor subclass as
    # ``x.new_empty(x.size(), device=...)``, then fills its slots (the local tensor, the
    # spec) and attributes. On torch 2.13 a DTensor's ``data_ptr()`` is its local tensor's
    # storage offset (in bytes), which the stager takes for storage of its own; a Piece is
    # a wrapper without storage (0, as on torch 2.11). Its ``new_empty`` of its own shape is
    # a Piece laid out like it (DTensor's would be torch.chunk rows, a copy that writes
    # and pickles as a plain DTensor).
    def data_ptr(self) -> int:
        return 0

    def new_empty(self, *size, **kwargs) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        if (tuple(shape) == tuple(self.shape) and kwargs.get("dtype") in (None, self.dtype)
                and not kwargs.get("requires_grad")):
            return piece_like(self, self._local_tensor.new_empty(
                self._local_tensor.shape, **kwargs))
        return super().new_empty(*size, **kwargs)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None
                 ) -> torch.Tensor:
        if PENDING:  # the caller may write into it (it bumps main's version counter)
            before_write([self])
        return super().to_local(grad_placements=grad_placements)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None
                    ) -> torch.Tensor:
        if torch.is_grad_enabled() and self.requires_grad:
            raise RuntimeError(
                "hsdp: full_tensor() of a sharded parameter is not differentiable (its "
                "gradient would miss hsdp's reduction). Call it under torch.no_grad() or "
                "on p.detach(), or use the parameter inside its unit's forward, where it is "
                "whole.")
        start, length = self._hsdp_range
        local = self._local_tensor
        block = block_of(self._spec)  # None: this rank's tp ranks hold it whole
        shape = self.shape if block is None else block.local_shape
        full = torch.zeros(shape, dtype=local.dtype, device=local.device)
        full.view(-1)[start:start + length] = local.detach().reshape(-1)[:length]
        dp = self._hsdp_groups if block is None else self._hsdp_groups[:-1]
        for group in dp:  # every element is held by one rank: sum = gather
            dist.all_reduce(full, group=group)
        return full if block is None else block.whole(full, self._hsdp_groups[-1])

    def redistribute(self, device_mesh: DeviceMesh | None = None,
                     placements: Sequence[Placement] | None = None, *,
                     async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> DTensor:
        mesh = device_mesh or self.device_mesh
        if (mesh == self.device_mesh and placements is not None
                and all(p.is_replicate() for p in placements)
                and forward_dtype in (None, self.dtype)):
            return DTensor.from_local(self.full_tensor(), mesh, placements, run_check=False)
        raise RuntimeError(
            f"hsdp: cannot redistribute an hsdp shard to {placements}: its local tensor is a "
            f"flat range of the parameter, not torch.chunk rows. Use full_tensor() or "
            f"redistribute to Replicate() placements, hsdp.full_state_dict(model) for whole "
            f"tensors, or hsdp.get_state_dict with torch.distributed.checkpoint to reshard.")

    # DCP reads where the elements lie from these (before DTensor's placements, which
    # would say torch.chunk rows): for every Piece, also the optimizer state that torch's
    # ops made from one (whose local tensor has no chunk hooks, see ``attach_chunks``).
    def _chunks(self) -> Chunks:
        return Chunks(tuple(self._spec.shape), *self._hsdp_range, block_of(self._spec),
                      writes(self._spec))

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks().chunk_list()

    def __create_write_items__(self, fqn: str, _obj: object) -> list[WriteItem]:
        return self._chunks().write_items(fqn, self._local_tensor)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._chunks().shard(index, self._local_tensor)

    def __reduce_ex__(self, protocol: int) -> tuple:
        # The process groups do not pickle: the mesh does (by its ranks, as torch's
        # DTensors do), and they are looked up again from it where it is unpickled. The
        # local tensor without its chunk hooks (closures) - a fresh alias, no copy.
        with direct():
            requires_grad = self.requires_grad
        return (_rebuild, (self._local_tensor.detach(), self._spec, self._hsdp_range,
                           requires_grad))

    def __deepcopy__(self, memo: dict) -> Piece:
        with direct():
            requires_grad = self.requires_grad
        out = piece_like(self, self._local_tensor.detach().clone())
        if requires_grad:
            out.requires_grad_(True)
        memo[id(self)] = out
        return out


def _rebuild(local: torch.Tensor, dspec: DTensorSpec, hsdp_range: tuple[int, int],
             requires_grad: bool) -> Piece:
    """An unpickled Piece (``Piece.__reduce_ex__``). Where hsdp's mesh is not in this
    process (torch's checkpoint process, which only writes it), what needs its groups
    raises (``Piece._hsdp_groups``)."""
    out = as_dtensor(local, dspec, *hsdp_range)
    if requires_grad:
        out.requires_grad_(True)
    return out


# torch.load's default (weights_only) unpickler accepts torch's own DTensors; hsdp's too.
torch.serialization.add_safe_globals([_rebuild])


def as_dtensor(local: torch.Tensor, dspec: DTensorSpec, start: int, length: int) -> Piece:
    """A Piece over the 1-D ``local`` piece itself, elements ``[start, start + length)`` of
    the flattened tensor (no copy, no autograd; writes into its local tensor bump
    ``local``'s own version counter)."""
    # ``Piece.__new__`` (torch's C++ constructor) without ``Piece(...)``, which also runs
    # ``DTensor.__init__``: it does nothing, behind a dynamo-disabling wrapper that costs
    # more than the construction (the optimizer makes 75 new Pieces a step here).
    out = Piece.__new__(Piece, local, dspec, requires_grad=False)
    out._hsdp_range = (start, length)
    return out


def piece_like(piece: Piece, local: torch.Tensor) -> Piece:
    """A Piece laid out like ``piece`` over ``local`` (no copy)."""
    return as_dtensor(local, piece._spec, *piece._hsdp_range)


def placeholders_if_empty(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """``views``, each empty one replaced by a one-element zero placeholder: torch's
    inf-norm (``clip_grad_norm_``) raises on an empty local tensor, which would fail on
    some ranks only. Zero gradients keep a placeholder at zero under every torch
    optimizer. The placeholders are views of one tensor (the caching allocator gives each
    tensor at least 512 bytes)."""
    k = sum(v.numel() == 0 for v in views)
    if not k:
        return views
    spare = iter(torch.zeros(k, dtype=views[0].dtype, device=views[0].device).split(1))
    return [v if v.numel() else next(spare) for v in views]


def checkpoint_view(like: Piece, local: torch.Tensor) -> Piece:
    """A Piece laid out like ``like`` over ``local`` that carries the chunk hooks (what
    state dicts hold: DCP writes from and loads into it in place)."""
    local = local.view(-1)  # a fresh alias: the hooks are attributes of the tensor object
    attach_chunks(local, like._spec, *like._hsdp_range)
    return piece_like(like, local)


def same_layout(state: torch.Tensor, param: DTensor) -> bool:
    """Whether ``state`` (optimizer state of ``param``, or what an elementwise op on it
    returned) is laid out like ``param``'s piece: a DTensor on the same mesh with the same
    placements, shape and local size (read from the specs: no op on a Piece)."""
    return (isinstance(state, DTensor) and state._spec.shape == param._spec.shape
            and state._spec.placements == param._spec.placements
            and state._spec.mesh == param._spec.mesh
            and state._local_tensor.numel() == param._local_tensor.numel())


def adopt_state(params_state: dict) -> None:
    """Make the optimizer state of hsdp parameters (``optimizer.state``; plain DTensors
    that torch's ops made from the Pieces) Pieces over the same local tensors, so that
    their ``full_tensor()`` is right too. No copy."""
    for p, st in params_state.items():
        if not isinstance(p, Piece):
            continue
        for k, v in st.items():
            if type(v) is DTensor and same_layout(v, p):
                st[k] = piece_like(p, v._local_tensor)
