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

from hsdp.mesh import registered_groups
from hsdp.sharding.chunks import Chunks, attach_chunks
from hsdp.sharding.reductions import DECLINED, SPECIAL, special
from hsdp.sharding.tp import block_of
from hsdp.sharding.write_guard import (
    DATA,
    PENDING,
    any_requires_grad,
    before_write,
    direct,
    written,
)


def placements(shard_outer: bool, tp: Placement | None = None) -> tuple:
    """Over ("outer", "inner") and, on a 3-D mesh, the parameter's TP placement ``tp``."""
    dp = (Shard(0) if shard_outer else Replicate(), Shard(0))
    return dp if tp is None else (*dp, tp)


def spec(mesh: DeviceMesh, shard_outer: bool, shape: tuple[int, ...],
         dtype: torch.dtype, tp: Placement | None = None) -> DTensorSpec:
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, placements(shard_outer, tp),
                       tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


# Elementwise ops that optimizers and zero_grad run on parameters, gradients and state, as
# ``__torch_function__`` sees them (torch functions and Tensor methods): on pieces laid out
# alike, the same op on the local tensors (see ``Piece``).
_ELEMENTWISE_NAMES = (
    *(f"_foreach_{n}{s}" for n in ("add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp",
                                   "sqrt", "maximum", "neg", "abs", "sign", "clamp_min",
                                   "clamp_max") for s in ("", "_")),
    "_foreach_copy_", "_foreach_zero_", "_fused_adam_", "_fused_adamw_", "_fused_sgd_",
    "_fused_adagrad_", "add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_",
    "zero_")
# Out of place on one tensor, as torch functions and Tensor methods (the per-parameter
# optimizers: ``exp_avg_sq.sqrt() / c``, ``grad.add(p, alpha=wd)``, ``-grad``).
_SINGLE = frozenset(getattr(ns, n) for n in ("sqrt", "div", "add", "sub", "mul", "neg")
                    for ns in (torch, torch.Tensor))
_ELEMENTWISE = frozenset(f for f in (getattr(torch, n, None) or getattr(torch.Tensor, n, None)
                                     for n in _ELEMENTWISE_NAMES) if f is not None) | _SINGLE


# Reads of a tensor's attributes and metadata, which write nothing and are no op on its
# elements: what optimizers ask of every parameter each step (``p.grad``,
# ``torch.is_complex(p)``, ``p.grad.is_sparse``). ``Piece.__torch_function__`` hands them to
# torch at once: none of its checks applies to them, and they are most of its calls.
_READS = frozenset({
    *(getattr(torch.Tensor, n).__get__ for n in (
        "grad", "is_sparse", "device", "dtype", "requires_grad", "is_leaf", "layout",
        "shape", "ndim", "is_cuda")),
    torch.is_complex, torch.is_floating_point, torch.Tensor.is_complex,
    torch.Tensor.is_floating_point, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.size})


def _aligned(s: DTensorSpec, r: DTensorSpec | None) -> bool:
    return s is r or (r is not None and s.placements == r.placements and s.shape == r.shape
                      and s.mesh == r.mesh)


def _local_arg(a, spec: DTensorSpec):
    """A later argument of ``_on_local`` (``spec``: its first's): the local tensor of a
    DTensor aligned with the first, a plain scalar tensor or a non-tensor as is, else
    ``DECLINED``."""
    if isinstance(a, DTensor):
        return a._local_tensor if _aligned(a._spec, spec) else DECLINED
    if isinstance(a, torch.Tensor):
        return DECLINED if a.dim() else a
    return DECLINED if isinstance(a, (list, tuple)) else a


def _on_local(func, args: tuple, kwargs: dict):
    """``_on_locals`` for an op on single tensors (a per-parameter optimizer's), without its
    lists: the first argument a DTensor, the other tensors DTensors aligned with it or
    scalars. An out-of-place op whose result does not have the first's local shape and
    dtype (a type promotion, a broadcast) or that is given ``out=`` is ``DECLINED``."""
    first = args[0]
    if not isinstance(first, DTensor):
        return DECLINED
    spec = first._spec
    new_args = [first._local_tensor]
    for a in args[1:]:
        a = _local_arg(a, spec)
        if a is DECLINED:
            return DECLINED
        new_args.append(a)
    new_kwargs = {}
    for k, a in kwargs.items():
        a = new_kwargs[k] = _local_arg(a, spec)
        if a is DECLINED or k == "out":
            return DECLINED
    out = func(*new_args, **new_kwargs)
    if func not in _SINGLE:  # in place: self
        return first
    held = new_args[0]
    if out.dtype != held.dtype or out.shape != held.shape:
        return DECLINED
    return (piece_like(first, out) if isinstance(first, Piece)
            else DTensor(out, spec, requires_grad=False))


def _on_locals(func, args: tuple, kwargs: dict):
    """``func`` run on the local tensors of its DTensor arguments, or ``DECLINED`` unless
    every DTensor lines up with the others at its position (same placements, mesh and
    global shape; foreach lists position by position) and every plain tensor is a scalar.
    Then the local op is exactly the distributed one: elementwise over aligned pieces."""
    if args and not isinstance(args[0], (list, tuple)):
        return _on_local(func, args, kwargs)
    refs: list | None = None  # the spec at each position (one for single-tensor ops)
    first: list | None = None  # the first tensor argument (list) itself

    def unwrap(a):
        nonlocal refs, first
        tensors = [a] if isinstance(a, torch.Tensor) else a
        if not (isinstance(tensors, (list, tuple)) and tensors
                and isinstance(tensors[0], torch.Tensor)):
            return a
        # Fast path (the optimizer's lists: all DTensors, specs equal position by
        # position, mostly the same objects, which list equality checks first): list
        # comprehensions instead of a Python loop with a call per tensor.
        if refs is None:
            first = tensors
            try:  # all DTensors: aligned with themselves
                refs, aligned = [t._spec for t in tensors], True
            except AttributeError:  # a plain tensor (only scalars are allowed)
                refs = [t._spec if isinstance(t, DTensor) else None for t in tensors]
                aligned = False
        elif len(tensors) != len(refs):
            return DECLINED
        else:
            try:
                aligned = [t._spec for t in tensors] == refs
            except AttributeError:
                aligned = False
        if aligned:
            locals_ = [t._local_tensor for t in tensors]
            return locals_[0] if isinstance(a, torch.Tensor) else locals_
        out = []
        for t, r in zip(tensors, refs):
            if isinstance(t, DTensor):
                if not _aligned(t._spec, r):
                    return DECLINED
                out.append(t._local_tensor)
            elif t.dim() == 0:
                out.append(t)
            else:
                return DECLINED
        return out[0] if isinstance(a, torch.Tensor) else out

    new_args = [unwrap(a) for a in args]
    new_kwargs = {k: unwrap(v) for k, v in kwargs.items()}
    if any(a is DECLINED for a in (*new_args, *new_kwargs.values())):
        return DECLINED
    if func.__name__.endswith("_"):  # in place: foreach -> None, single -> self
        out = func(*new_args, **new_kwargs)
        return args[0] if isinstance(args[0], DTensor) else out
    out = _by_runs(func, new_args, new_kwargs)
    # New tensors (e.g. AdamW's sqrt of its second moment) are laid out like the first
    # argument's: Pieces where those are, so that the ops the optimizer runs on them next
    # take this path too, not DTensor's (which re-checks every spec at each op).
    return [piece_like(t, o) if isinstance(t, Piece) else DTensor(o, r, requires_grad=False)
            for t, o, r in zip(first, out, refs)]


def contiguous_runs(ts: list[torch.Tensor]) -> list[int]:
    """Lengths of the runs of consecutive 1-D contiguous tensors in ``ts`` that lie back to
    back in one storage (the pieces of a group's flat buffer), front to back."""
    lengths: list[int] = []
    end = None  # (storage pointer, dtype, offset) where the previous tensor ended
    for t in ts:
        flat = t.dim() == 1 and t.stride(0) == 1
        here = (t.untyped_storage().data_ptr(), t.dtype, t.storage_offset())
        if flat and here[0] and end == here:  # a null pointer: meta tensors
            lengths[-1] += 1
        else:
            lengths.append(1)
        end = (here[0], here[1], here[2] + t.numel()) if flat else None
    return lengths


def _by_runs(func, args: list, kwargs: dict) -> list[torch.Tensor] | torch.Tensor:
    """An out-of-place op on local tensors. A foreach op whose only tensor argument is its
    first list runs once over each run of back-to-back pieces (``contiguous_runs``), the results
    being views of one new tensor per run: one allocation of the group's size instead of
    one odd-sized allocation per piece (each of which the caching allocator rounds), as
    for the packed optimizer state; same values, element by element."""
    ts = args[0]
    if not (isinstance(ts, list) and func.__name__.startswith("_foreach_") and not kwargs
            and not any(isinstance(a, (torch.Tensor, list, tuple)) for a in args[1:])):
        return func(*args, **kwargs)
    lengths = contiguous_runs(ts)
    if len(lengths) == len(ts):
        return func(*args, **kwargs)
    spans, i = [], 0
    for n in lengths:
        first = ts[i]
        numel = sum(t.numel() for t in ts[i:i + n])
        spans.append(first if n == 1 else first.as_strided((numel,), (1,),
                                                           first.storage_offset()))
        i += n
    out, i = [], 0
    for n, res in zip(lengths, func(spans, *args[1:])):
        out += [res] if n == 1 else list(res.split([t.numel() for t in ts[i:i + n]]))
        i += n
    return out


_DISABLED = torch._C._disabled_torch_function_impl
_GRAD, _IS_SPARSE = torch._C.TensorBase.grad, torch._C.TensorBase.is_sparse


def _as_piece(out: DTensor, arg: object) -> DTensor:
    """``out``, a DTensor that torch computed from ``arg``, as a Piece where it was computed
    elementwise from one (a clone, p - 1, p.abs(), p == 0), so that what is computed from
    it next knows where its elements lie."""
    if isinstance(arg, Piece) and not out.requires_grad and same_layout(out, arg):
        return as_dtensor(out._local_tensor, out._spec, *arg._hsdp_range, arg._hsdp_groups)
    return out


class Piece(DTensor):
    """A DTensor over one of hsdp's flat pieces: what parameters, their ``.grad`` and
    state-dict views are. ``full_tensor()`` assembles the pieces (a collective over the
    mesh, host groups); ``redistribute`` to replicated placements goes through it, any other
    is refused (torch's redistribution assumes ``torch.chunk`` rows and would misread
    the pieces). Elementwise foreach ops on Pieces return Pieces (``_on_locals``), other
    ops plain DTensors (torch's dispatch)."""

    _hsdp_range: tuple[int, int]  # (start, length) in the flattened TP-local tensor
    # whose sum assembles the pieces: inner, outer (hfsdp), tp (a TP-sharded parameter)
    _hsdp_groups: tuple[dist.ProcessGroup, ...]

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
        if func not in _READS:  # (a read writes nothing and is none of the ops below)
            if getattr(func, "__self__", None) is DATA:
                group = getattr(args[0], "_hsdp_group", None)
                if group is not None:  # writes through .data bump no version counter
                    group.mark_written()
            if PENDING.data:  # (``len(PENDING)`` is a Python call)
                before_write(written(func, args, kwargs))
            if func in _ELEMENTWISE and not (torch.is_grad_enabled() and any_requires_grad(
                    (*args, *kwargs.values()))):
                out = _on_locals(func, args, kwargs)
                if out is not DECLINED:
                    return out
            kind = SPECIAL.get(func)
            if kind is not None:
                out = special(cls, kind, args, kwargs)
                if out is not DECLINED:
                    return out
        out = _DISABLED(func, types, args, kwargs)
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
        return Chunks(tuple(self._spec.shape), *self._hsdp_range, block_of(self._spec))

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
    """An unpickled Piece (``Piece.__reduce_ex__``), on hsdp's groups of its mesh."""
    groups = registered_groups(dspec.mesh)
    if groups is None:
        raise RuntimeError(
            "hsdp: unpickling an hsdp shard (a DTensor of a model sharded by hsdp) needs "
            "hsdp's mesh with the same ranks in this process (hsdp.init_mesh, then "
            "fully_shard); for tensors that load anywhere save hsdp.full_state_dict(model)")
    out = as_dtensor(local, dspec, *hsdp_range,
                     groups.piece_groups(dspec.placements[0].is_shard(),
                                         block_of(dspec) is not None))
    if requires_grad:
        out.requires_grad_(True)
    return out


# torch.load's default (weights_only) unpickler accepts torch's own DTensors; hsdp's too.
torch.serialization.add_safe_globals([_rebuild])


def as_dtensor(local: torch.Tensor, dspec: DTensorSpec, start: int, length: int,
               groups: tuple[dist.ProcessGroup, ...]) -> Piece:
    """A Piece over the 1-D ``local`` piece itself, elements ``[start, start + length)`` of
    the flattened tensor (no copy, no autograd; writes into its local tensor bump
    ``local``'s own version counter). ``groups``: host groups of the dims it is sharded on."""
    # ``Piece.__new__`` (torch's C++ constructor) without ``Piece(...)``, which also runs
    # ``DTensor.__init__``: it does nothing, behind a dynamo-disabling wrapper that costs
    # more than the construction (the optimizer makes 75 new Pieces a step here).
    out = Piece.__new__(Piece, local, dspec, requires_grad=False)
    out._hsdp_range, out._hsdp_groups = (start, length), groups
    return out


def piece_like(piece: Piece, local: torch.Tensor) -> Piece:
    """A Piece laid out like ``piece`` over ``local`` (no copy)."""
    return as_dtensor(local, piece._spec, *piece._hsdp_range, piece._hsdp_groups)


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
