"""Bad input and calls in the wrong phase fail with clear errors."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import hsdp
from hsdp.sharding.group_grads import GradientState


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
    """A meta module gets meta shards (the simulator runs such models); a module with
    parameters on the meta device and elsewhere is refused."""
    mesh = hsdp.init_mesh(2, 4, "cpu")
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    hsdp.fully_shard(m, mesh=mesh)
    assert all(p.is_meta for p in m.parameters())
    assert m(torch.randn(3, 4, device="meta")).shape == (3, 4)
    mixed = nn.Sequential(nn.Linear(4, 4))
    with torch.device("meta"):
        mixed.append(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="meta device and some are not"):
        hsdp.fully_shard(mixed, mesh=mesh)


def test_optimizer_step_while_outer_reduction_pending(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _sharded(mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with hsdp.microbatch(m, is_last=False):
        m(torch.randn(2, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="gradient reduction is still pending"):
        opt.step()
    with pytest.raises(RuntimeError, match="not final"):
        hsdp.clip_grad_norm_(m, 1.0)
    with hsdp.microbatch(m, is_last=True):
        with pytest.raises(RuntimeError, match="nested"):
            with hsdp.microbatch(m, is_last=True):
                pass
        m(torch.randn(2, 5)).sum().backward()
    opt.step()  # the final microbatch made the gradients final


def test_gradients_left_set_are_accumulated_without_warning(fake_world_8):
    """As in torch: a .grad not cleared is added to, silently (values: test_drop_in.py)."""
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _sharded(mesh)
    m(torch.randn(2, 5)).sum().backward()
    for p in m.parameters():  # the fake world's collectives leave them undefined
        p.grad.fill_(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(torch.randn(2, 5)).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_replaced_grad_of_another_layout_is_refused(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _sharded(mesh)
    m(torch.randn(2, 5)).sum().backward()
    p = m[0].weight
    p.grad = torch.distributed.tensor.distribute_tensor(
        torch.ones(p.shape), mesh, p.placements)  # even chunks, not hsdp's pieces
    with pytest.raises(RuntimeError, match="cannot accumulate into it"):
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


def test_mesh_errors_are_hsdps(fake_world_8, monkeypatch):
    with pytest.raises(ValueError, match="positive ints"):
        hsdp.init_mesh(True, 8, "cpu")
    with pytest.raises(ValueError, match="world has 8 ranks"):
        hsdp.init_mesh(3, 2, "cpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        hsdp.init_mesh(2, 4, "xpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        hsdp.init_mesh(2, 2, "cuda")


def test_mesh_without_process_group_or_torchrun(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        hsdp.init_mesh(1, 1, "cpu")


def test_version():
    assert isinstance(hsdp.__version__, str) and hsdp.__version__.count(".") == 2


def test_dtype_and_device_changes_after_sharding(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _sharded(mesh)
    before = list(m.parameters())
    for convert in (m.double, m.half, lambda: m.to_empty(device="cpu")):
        with pytest.raises(RuntimeError, match="after fully_shard would replace"):
            convert()
    # Refused before anything changed; conversions that change nothing are fine.
    m.float().to("cpu").cpu().to(torch.float32)
    assert [p for p in m.parameters()] == before
    assert all(p.dtype == torch.float32 for p in m.parameters())
    m(torch.randn(2, 5)).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


def test_zero_grad_in_place_counts_as_cleared(fake_world_8, monkeypatch):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _sharded(mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 5)).sum().backward()
    carried = []
    hide = GradientState.hide_grads

    def spy(grads: GradientState, capturing: bool = False, single: bool = False) -> None:
        hide(grads, capturing, single)
        carried.append(grads.carry is not None)

    monkeypatch.setattr(GradientState, "hide_grads", spy)
    for clear in (lambda: opt.zero_grad(set_to_none=False),
                  lambda: m.zero_grad(set_to_none=False)):
        hsdp.clip_grad_norm_(m, 1.0)  # writes the gradients in place too
        opt.step()
        clear()
        assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
        m(torch.randn(2, 5)).sum().backward()
        # Zeros are not carried into the new step (no copy, no extra memory).
        assert carried and not any(carried), carried
        carried.clear()


def test_fsdp2_style_options_misused(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    with pytest.raises(TypeError, match="reshard_after_forward must be a bool"):
        hsdp.fully_shard(_model(), mesh=mesh, reshard_after_forward="yes")
    with pytest.raises(ValueError, match="reshard_after_forward=2 .* use True"):
        hsdp.fully_shard(_model(), mesh=mesh, reshard_after_forward=2)
    m = _sharded(mesh)
    with pytest.raises(RuntimeError, match="call it on the root"):
        m[0].set_requires_gradient_sync(False)
    with pytest.raises(ValueError, match="prefetch targets"):
        m[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.set_requires_gradient_sync(False)
    m(torch.randn(2, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="set_requires_gradient_sync"):
        opt.step()
    m.set_requires_gradient_sync(True)
    m(torch.randn(2, 5)).sum().backward()
    opt.step()


def test_hfsdp_cannot_unfreeze_what_was_frozen_at_fully_shard(fake_world_8):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    m = _model()
    m[1].requires_grad_(False)
    for layer in m:
        hsdp.fully_shard(layer, mesh=mesh, strategy="hfsdp")
    hsdp.fully_shard(m, mesh=mesh, strategy="hfsdp")
    m(torch.randn(2, 5)).sum().backward()
    m[1].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="frozen when fully_shard ran"):
        m(torch.randn(2, 5))
