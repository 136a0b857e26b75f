"""Optimizer math on hsdp's Pieces (fake 2x4 world): the same values as on the local
tensors, and new tensors laid out like their inputs."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import hsdp
from hsdp.sharding.pieces import Piece, as_dtensor, spec

SHAPES = [(6, 5), (7,), (3, 4, 2)]


def _pieces(mesh, seed: int) -> list[Piece]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(SHAPES):
        n = 3 + i  # this rank's piece: a flat range of the parameter
        out.append(as_dtensor(torch.randn(n, generator=g), spec(mesh, False, shape,
                                                              torch.float32), i, n))
    return out


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_optimizer_on_pieces_matches_local_tensors(fake_world_8, opt_cls, foreach):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    params = [nn.Parameter(p) for p in _pieces(mesh, 0)]
    plain = [nn.Parameter(p._local_tensor.clone()) for p in params]
    kw = {"lr": 0.1, "foreach": foreach,
          **({"momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "maximize": True}
             if opt_cls is torch.optim.SGD else {"weight_decay": 0.1})}
    opt, ref = opt_cls(params, **kw), opt_cls(plain, **kw)
    for step in range(3):
        for p, q, g in zip(params, plain, _pieces(mesh, step + 1)):
            p.grad, q.grad = g, g._local_tensor.clone()
        opt.step()
        ref.step()
    for p, q in zip(params, plain):
        assert isinstance(p, Piece)
        assert torch.equal(p._local_tensor, q.detach())
    for st, st_ref in zip(opt.state.values(), ref.state.values()):
        for k, v in st_ref.items():
            assert torch.equal(getattr(st[k], "_local_tensor", st[k]), v), k  # "step": plain


def test_foreach_results_have_the_local_ops_values(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    xs = _pieces(mesh, 0)
    roots = torch._foreach_sqrt(torch._foreach_abs(xs))
    for x, r in zip(xs, roots):
        assert torch.equal(r._local_tensor, x._local_tensor.abs().sqrt())
    torch._foreach_add_(roots, xs)  # in place on results: still the local op
    for x, r in zip(xs, roots):
        assert torch.equal(r._local_tensor, x._local_tensor.abs().sqrt() + x._local_tensor)


def test_single_tensor_results_are_pieces_with_the_local_ops_values(fake_world_8):
    """What a per-parameter optimizer computes out of place (``x.sqrt() / c``,
    ``g.add(p, alpha=wd)``, ``-g``): Pieces laid out like ``x``, the local op's values;
    one that changes the dtype (an integer piece divided) is torch's DTensor result."""
    mesh = hsdp.init_mesh(2, 4, "cpu")
    xs = [as_dtensor(x._local_tensor.abs(), x._spec, *x._hsdp_range)
          for x in _pieces(mesh, 0)]
    for x, y in zip(xs, _pieces(mesh, 1)):
        a, b = x._local_tensor, y._local_tensor
        for out, ref in ((x.sqrt() / 3.0, a.sqrt() / 3.0), (torch.sqrt(x), a.sqrt()),
                         (x.add(y, alpha=0.5), a.add(b, alpha=0.5)), (-x, -a),
                         (torch.mul(x, y), a * b), (x.sub(y), a - b),
                         (x.div(torch.tensor(2.0)), a / 2)):
            assert type(out) is Piece and out._spec is x._spec
            assert out._hsdp_range == x._hsdp_range
            assert torch.equal(out._local_tensor, ref)
        ints = as_dtensor(torch.arange(a.numel()), spec(mesh, False, x.shape, torch.int64),
                          *x._hsdp_range)
        half = ints.div(2)
        assert half.dtype == torch.float32 and half._spec.tensor_meta.dtype == torch.float32
        assert torch.equal(half._local_tensor, torch.arange(a.numel()) / 2)


def test_grad_reads_and_writes_as_torch_does(fake_world_8):
    """``p.grad`` of a Piece (read without ``__torch_function__``): what was set, a grad of
    its layout that torch's ops made as a Piece, settable, deletable and checked."""
    mesh = hsdp.init_mesh(2, 4, "cpu")
    p = nn.Parameter(_pieces(mesh, 0)[0])
    assert p.grad is None and not p.is_sparse
    g = _pieces(mesh, 1)[0]
    p.grad = g
    assert p.grad is g and not p.grad.is_sparse
    made = DTensor(g._local_tensor.clone(), g._spec, requires_grad=False)
    p.grad = made
    assert type(p.grad) is Piece and p.grad._hsdp_range == p._hsdp_range
    assert torch.equal(p.grad._local_tensor, made._local_tensor)
    del p.grad
    assert p.grad is None
    with pytest.raises(RuntimeError, match="size"):
        p.grad = torch.zeros(3)


# On torch 2.11 DTensor dispatches in C++ and never calls a subclass's __torch_dispatch__:
# the fast path must hold there too (checked on 2.11 and 2.13).
def test_foreach_results_are_pieces_laid_out_like_their_inputs(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    xs = _pieces(mesh, 0)
    roots = torch._foreach_sqrt(torch._foreach_abs(xs))
    for x, r in zip(xs, roots):
        assert type(r) is Piece and r._spec is x._spec
        assert r._hsdp_range == x._hsdp_range


def test_in_place_op_on_a_parameter_under_autograd_is_checked_as_torch_does(fake_world_8):
    """The local fast path runs only without autograd: with it, an in-place op on a
    parameter that requires grad raises as it does on a plain parameter."""
    mesh = hsdp.init_mesh(2, 4, "cpu")
    p = nn.Parameter(_pieces(mesh, 0)[0])
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        p.mul_(2.0)
    with torch.no_grad():
        p.mul_(2.0)
    assert torch.equal(p._local_tensor, _pieces(mesh, 0)[0]._local_tensor * 2)


def test_runs_of_back_to_back_pieces():
    """``contiguous_runs``: consecutive 1-D views that continue one another in one storage, with the
    same dtype, form a run; a gap, a repeat, another dtype or meta tensors break it."""
    from hsdp.sharding.local_ops import contiguous_runs
    b = torch.zeros(10)
    assert contiguous_runs([b[0:2], b[2:5], b[5:6], b[7:8], b[8:10]]) == [3, 2]
    assert contiguous_runs([b[0:2], b[0:2]]) == [1, 1]
    assert contiguous_runs([b.view(torch.int32)[0:2], b[2:4]]) == [1, 1]
    assert contiguous_runs([b[0:4].view(2, 2), b[4:6]]) == [1, 1]
    meta = torch.zeros(3, device="meta")
    assert contiguous_runs([meta[0:1], meta[1:2]]) == [1, 1]


def test_torch_async_stager_copies_pieces_as_pieces_of_their_own(fake_world_8):
    """torch's async checkpoint stager (``dcp.async_save``) copies a tensor subclass as
    ``new_empty`` plus its slots and attributes: a Piece (here a view at an offset of a
    flat buffer, as hsdp's are) stages as a Piece over a copy, which pickles without the
    process groups and unpickles where hsdp has no mesh (torch's checkpoint process)."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    mesh = hsdp.init_mesh(2, 4, "cpu")
    flat = torch.arange(20.0)
    x = as_dtensor(flat[7:13], spec(mesh, False, (6, 5), torch.float32), 3, 6)
    staged = StateDictStager().stage({"x": x})["x"]
    assert type(staged) is Piece and staged._hsdp_range == x._hsdp_range
    assert torch.equal(staged._local_tensor, flat[7:13])
    flat.zero_()  # training goes on: the staged copy keeps the values
    assert torch.equal(staged._local_tensor, torch.arange(7.0, 13.0))
    assert staged._hsdp_groups == x._hsdp_groups
    buf = io.BytesIO()
    torch.save(staged, buf)
    dist.destroy_process_group()  # no hsdp mesh: it still loads; its groups are refused
    try:
        buf.seek(0)
        loaded = torch.load(buf)
        assert torch.equal(loaded._local_tensor, torch.arange(7.0, 13.0))
        with pytest.raises(RuntimeError, match="needs hsdp's mesh"):
            loaded.full_tensor()
    finally:
        dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
