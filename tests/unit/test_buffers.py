"""Buffer lifetimes (fake 2x4 world): gathered parameters and gradient buffers exist only
while needed."""

import pytest
import torch
import torch.nn as nn

import hsdp
from hsdp.sharding.group_io import GroupIO


def _net(strategy: str) -> nn.Sequential:
    mesh = hsdp.init_mesh(2, 4, "cpu")
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in (net[0], net[2]):
        hsdp.fully_shard(layer, mesh=mesh, strategy=strategy)
    return hsdp.fully_shard(net, mesh=mesh, strategy=strategy)


def _groups(net: nn.Module):
    return [g for m in net.modules() if getattr(m, "_hsdp_unit", None)
            for g in m._hsdp_unit.trainable]


def _live(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_gradient_buffers_live_from_reduce_scatter_to_zero_grad(fake_world_8, strategy):
    net = _net(strategy)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert not any(_live(g.grads.accum) or _live(g.grads.grad_buf) for g in _groups(net))
    net(torch.randn(2, 8)).sum().backward()
    assert all(_live(g.grads.accum) and _live(g.grads.grad_buf) for g in _groups(net))
    assert all(p.grad is not None for p in net.parameters())
    opt.step()
    opt.zero_grad()
    net(torch.randn(2, 8))  # the next step's forward: cleared gradients are freed
    hsdp.synchronize(net)
    assert not any(_live(g.grads.accum) or _live(g.grads.grad_buf) for g in _groups(net))


def test_uncleared_gradients_are_kept_through_the_forward(fake_world_8):
    net = _net("hsdp")
    net(torch.randn(2, 8)).sum().backward()
    net(torch.randn(2, 8))
    hsdp.synchronize(net)
    assert all(_live(g.grads.accum) for g in _groups(net))


def test_no_gathered_buffer_outlives_its_step(fake_world_8):
    net = _net("hsdp")
    net(torch.randn(2, 8)).sum().backward()
    hsdp.synchronize(net)
    units = [m._hsdp_unit for m in net.modules() if getattr(m, "_hsdp_unit", None)]
    assert not any(_live(g.buffers.gathered) for u in units for g in u.groups)
    with torch.no_grad():
        net(torch.randn(2, 8))  # no backward follows: everything is released at once
    hsdp.synchronize(net)
    assert not any(_live(g.buffers.gathered) for u in units for g in u.groups)


def _packed(opt: torch.optim.Optimizer, key: str) -> int:
    """How many storages hold ``key`` of the optimizer's state."""
    return len({st[key]._local_tensor.untyped_storage().data_ptr()
                for st in opt.state.values()})


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_optimizer_state_is_one_buffer_per_group_and_key(fake_world_8, strategy, monkeypatch):
    """AdamW's moments of a group's parameters become views into one buffer per moment of
    the group's shard size, at their parameters' offsets (instead of one odd-sized
    allocation per parameter), with the values they had; new state (a load) is packed
    again at the next step."""
    snapshots = []

    def pack_and_check(self, state, pack=GroupIO.pack_state):
        held = [q.sharded for q in self.b.params if q.sharded in state]
        before = {(id(p), k): v._local_tensor.clone() for p in held
                  for k, v in state[p].items() if v.dim()}
        pack(self, state)
        after = {(id(p), k): v._local_tensor for p in held
                 for k, v in state[p].items() if v.dim()}
        # Bit for bit: the fake world's collectives leave garbage (NaNs too) in the values.
        snapshots.append(before.keys() == after.keys() and all(
            torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))
            for k in before))

    monkeypatch.setattr(GroupIO, "pack_state", pack_and_check)
    mesh = hsdp.init_mesh(2, 4, "cpu")
    # Small sizes: several pieces of odd lengths in this rank's part of the root.
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 40), nn.Tanh(),
                        nn.Linear(40, 3))
    hsdp.fully_shard(net[4], mesh=mesh, strategy=strategy)
    hsdp.fully_shard(net, mesh=mesh, strategy=strategy)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)

    def step():
        net(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    pieces = []
    for g in _groups(net):
        held = [(q.sharded, q.offset, q.length) for q in g.params if q.length]
        pieces.append(len(held))
        for key in ("exp_avg", "exp_avg_sq"):
            locals_ = [opt.state[p][key]._local_tensor for p, _, _ in held]
            storage = locals_[0].untyped_storage()
            assert storage.nbytes() == g.main.numel() * g.main.element_size()
            assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in locals_)
            assert [t.storage_offset() for t in locals_] == [a for _, a, _ in held]
            assert [t.numel() for t in locals_] == [n for _, _, n in held]
    assert max(pieces) > 1
    assert snapshots and all(snapshots)
    packed = _packed(opt, "exp_avg")
    sd = opt.state_dict()  # as another optimizer would have it: one tensor per parameter
    opt.load_state_dict({"param_groups": sd["param_groups"], "state": {
        i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}})
    assert _packed(opt, "exp_avg") == len(opt.state) > packed
    step()
    assert _packed(opt, "exp_avg") == packed
    assert all(snapshots)


def test_out_of_place_optimizer_ops_allocate_once_per_group(fake_world_8):
    """An out-of-place foreach op over back-to-back pieces (AdamW's square root of its
    packed second moment) makes one tensor per group, whose views are the results, with
    the values of the op on each piece."""
    mesh = hsdp.init_mesh(2, 4, "cpu")
    # 16-element weights: back to back in the flat buffer, two in this rank's shard.
    net = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(8)])
    hsdp.fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    for _ in range(2):
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    held = [p for p in net.parameters() if p._local_tensor.untyped_storage().data_ptr()
            == _groups(net)[0].main.untyped_storage().data_ptr()]
    assert len(held) == 2
    moments = [opt.state[p]["exp_avg_sq"] for p in held]
    with torch.no_grad():
        roots = torch._foreach_sqrt(moments)
    assert all(isinstance(r, type(m)) for r, m in zip(roots, moments))
    locals_ = [r._local_tensor for r in roots]
    assert locals_[0].untyped_storage().data_ptr() == locals_[1].untyped_storage().data_ptr()
    assert locals_[0].untyped_storage().nbytes() == sum(t.nbytes for t in locals_)
    for r, m in zip(locals_, moments):
        assert torch.equal(r.view(torch.uint8), m._local_tensor.sqrt().view(torch.uint8))


def test_empty_pieces_placeholders_are_one_allocation_per_group(fake_world_8):
    """A rank's empty pieces hold one-element placeholders (torch's inf-norm refuses empty
    tensors); for the parameters, their gradients and each optimizer state key they are
    views of one tensor per group, not one allocation each."""
    mesh = hsdp.init_mesh(2, 4, "cpu")
    net = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(8)])
    hsdp.fully_shard(net, mesh=mesh)  # this rank: 2 of the 8 weights, 6 placeholders
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    for _ in range(2):
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
    g = _groups(net)[0]
    empty = [q.sharded for q in g.params if q.length == 0]
    assert len(empty) == 6

    def storages(tensors):
        return {t._local_tensor.untyped_storage().data_ptr() for t in tensors}

    for tensors in (empty, [p.grad for p in empty],
                    *([opt.state[p][k] for p in empty] for k in ("exp_avg", "exp_avg_sq"))):
        assert all(t._local_tensor.numel() == 1 for t in tensors)
        assert len(storages(tensors)) == 1
    assert all(p._local_tensor.item() == 0 for p in empty)
