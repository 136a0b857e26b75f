"""Bad input and calls in the wrong phase fail with clear errors."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import hsdp


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))


def _sharded(mesh) -> nn.Sequential:
    m = _model()
    for layer in m:
        hsdp.fully_shard(layer, mesh=mesh)
    return hsdp.fully_shard(m, mesh=mesh)


def test_mesh_size_must_match_world(fake_world_8):
    with pytest.raises(ValueError, match="world has 8 ranks"):
        hsdp.init_mesh(2, 3, "cpu")
    with pytest.raises(ValueError, match="positive"):
        hsdp.init_mesh(0, 8, "cpu")


def test_mesh_needs_dim_names(fake_world_8):
    mesh = init_device_mesh("cpu", (2, 4))
    with pytest.raises(ValueError, match="mesh_dim_names"):
        hsdp.fully_shard(_model(), mesh=mesh)


def test_unknown_strategy_and_nccl_key(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    with pytest.raises(ValueError, match="unknown strategy"):
        hsdp.fully_shard(_model(), mesh=mesh, strategy="zero3")
    with pytest.raises(ValueError, match="unknown communicator"):
        hsdp.init_mesh(2, 4, "cpu", nccl={"inner": hsdp.NcclConfig(max_ctas=4)})
    with pytest.raises(ValueError, match="non-negative"):
        hsdp.NcclConfig(max_ctas=-1)


def test_twice_and_top_down(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _sharded(mesh)
    with pytest.raises(RuntimeError, match="already applied"):
        hsdp.fully_shard(m, mesh=mesh)
    top = _model()
    hsdp.fully_shard(top, mesh=mesh)
    with pytest.raises(RuntimeError, match="bottom-up"):
        hsdp.fully_shard(top[0], mesh=mesh)


def test_meta_device_parameters(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="meta device"):
        hsdp.fully_shard(m, mesh=mesh)


def test_optimizer_step_while_outer_reduction_pending(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _sharded(mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with hsdp.microbatch(m, is_last=False):
        m(torch.randn(2, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="outer gradient reduction is still pending"):
        opt.step()
    with pytest.raises(RuntimeError, match="not final"):
        hsdp.clip_grad_norm_(m, 1.0)
    with hsdp.microbatch(m, is_last=True):
        with pytest.raises(RuntimeError, match="nested"):
            with hsdp.microbatch(m, is_last=True):
                pass
        m(torch.randn(2, 5)).sum().backward()
    opt.step()  # the final microbatch made the gradients final


def test_gradients_from_a_previous_step_are_reported(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _sharded(mesh)
    m(torch.randn(2, 5)).sum().backward()
    with pytest.warns(UserWarning, match="not cleared"):
        m(torch.randn(2, 5)).sum().backward()


def test_user_device_mesh_and_nccl_settings_on_gloo(fake_world_8):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("outer", "inner"))
    m = _sharded(mesh)  # hsdp's communicators are created on first use
    m(torch.randn(2, 5)).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    with pytest.warns(UserWarning, match="no effect"):
        hsdp.init_mesh(2, 4, "cpu", nccl={"outer": hsdp.NcclConfig(max_ctas=2)})


def test_overlap_outer_must_match_across_units(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _model()
    hsdp.fully_shard(m[0], mesh=mesh, overlap_outer=False)
    hsdp.fully_shard(m, mesh=mesh)
    with pytest.raises(ValueError, match="overlap_outer"):
        m(torch.randn(2, 5))
