"""Buffer lifetimes (fake 2x4 world): gathered parameters and gradient buffers exist only
while needed."""

import pytest
import torch
import torch.nn as nn

import hsdp


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
    assert not any(_live(g.accum) or _live(g.grad_buf) for g in _groups(net))
    net(torch.randn(2, 8)).sum().backward()
    assert all(_live(g.accum) and _live(g.grad_buf) for g in _groups(net))
    assert all(p.grad is not None for p in net.parameters())
    opt.step()
    opt.zero_grad()
    net(torch.randn(2, 8))  # the next step's forward: cleared gradients are freed
    hsdp.synchronize(net)
    assert not any(_live(g.accum) or _live(g.grad_buf) for g in _groups(net))


def test_uncleared_gradients_are_kept_through_the_forward(fake_world_8):
    net = _net("hsdp")
    net(torch.randn(2, 8)).sum().backward()
    net(torch.randn(2, 8))
    hsdp.synchronize(net)
    assert all(_live(g.accum) for g in _groups(net))


def test_no_gathered_buffer_outlives_its_step(fake_world_8):
    net = _net("hsdp")
    net(torch.randn(2, 8)).sum().backward()
    hsdp.synchronize(net)
    units = [m._hsdp_unit for m in net.modules() if getattr(m, "_hsdp_unit", None)]
    assert not any(_live(g.gathered) for u in units for g in u.groups)
    with torch.no_grad():
        net(torch.randn(2, 8))  # no backward follows: everything is released at once
    hsdp.synchronize(net)
    assert not any(_live(g.gathered) for u in units for g in u.groups)
