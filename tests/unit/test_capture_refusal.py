"""CUDA graphs on CPU (docs/design.md, "CUDA graphs"): the capture-only paths are never
taken on CPU, and what cannot be captured is refused, naming it, before anything changes.
CPU cannot capture: a capture is stood for by making the compute stream say it captures
(its ``capturing``), which runs hsdp's capture paths on real CPU work. The replay
against eager checks on the GPU are in tests/gpu/test_graphs.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import hsdp
import hsdp.runtime.recovery
from hsdp.runtime.step import Phase
from hsdp.streams.capture import CaptureError, CaptureScope


@pytest.fixture
def world_1():
    """One fake rank: a 1x1 mesh, whose collectives are local (real numerics)."""
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        yield hsdp.init_mesh(1, 1, "cpu")
    finally:
        dist.destroy_process_group()


def _net(mesh, **kw) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 4))
    hsdp.fully_shard(net[0], mesh=mesh, **kw)
    hsdp.fully_shard(net[2], mesh=mesh, **kw)
    return hsdp.fully_shard(net, mesh=mesh, **kw)


def _step(net, opt, x, n_micro=1) -> None:
    for i, xi in enumerate(x.chunk(n_micro)):
        with hsdp.microbatch(net, is_last=i == n_micro - 1):
            net(xi).square().mean().div(n_micro).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def test_cpu_never_takes_the_capture_paths(world_1, monkeypatch):
    """Even when CUDA says its current stream captures, a CPU model runs eagerly: the
    agreement runs in the backward, none is deferred to the optimizer step."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True,
                        raising=False)
    net = _net(world_1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    calls = []
    real = hsdp.runtime.recovery.agree
    monkeypatch.setattr(hsdp.runtime.recovery, "agree",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(2):
        _step(net, opt, torch.randn(6, 8))
    rt = net._hsdp_unit.runtime
    assert len(calls) == 2 and not rt.graphs.graphed and rt.graphs.captured is None


@pytest.mark.parametrize("n_micro", [1, 3])
def test_a_captured_step_equals_the_eager_one(world_1, monkeypatch, n_micro):
    """The capture paths (gradients always carried, the agreement deferred to the next
    optimizer step, side streams joined at each region's end), run on CPU work: the same
    parameters as eager, bit for bit."""
    eager, captured = _net(world_1), _net(world_1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, captured)]
    xs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    for x in xs[:1]:  # one eager step first: gradients and optimizer state exist
        for m, opt in zip((eager, captured), opts):
            _step(m, opt, x, n_micro)
    compute = captured._hsdp_unit.runtime.ctx.streams.compute
    for x in xs[1:]:
        _step(eager, opts[0], x, n_micro)
        with monkeypatch.context() as m:
            m.setattr(compute, "capturing", lambda: True)
            for i, xi in enumerate(x.chunk(n_micro)):
                with hsdp.microbatch(captured, is_last=i == n_micro - 1):
                    captured(xi).square().mean().div(n_micro).backward()
        opts[1].step()  # eager: runs the deferred agreement first
        opts[1].zero_grad(set_to_none=False)
    graphs = captured._hsdp_unit.runtime.graphs
    assert captured._hsdp_unit.runtime.graphs.graphed and graphs.steps == 3
    assert graphs.captured.microbatches == n_micro
    for a, b in zip(eager.parameters(), captured.parameters()):
        assert torch.equal(a.detach().full_tensor(), b.detach().full_tensor())


class _Unready:
    """A compressed reduction whose residual no eager step made yet."""

    def capture_refusal(self) -> str:
        return "the compressed outer reduction before its first optimizer step"


def test_refusals_name_what_cannot_be_captured(world_1, monkeypatch):
    net = _net(world_1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _step(net, opt, torch.randn(6, 8))
    rt = net._hsdp_unit.runtime

    def refused(match: str, fn) -> None:
        with monkeypatch.context() as m:
            m.setattr(rt.ctx.streams.compute, "capturing", lambda: True)
            with pytest.raises(CaptureError, match=match):
                fn()
        assert rt.step.phase is Phase.IDLE  # nothing started

    opt.zero_grad(set_to_none=True)
    refused(r"gradients are not set.*cannot be captured.*zero_grad\(set_to_none=False\)",
            lambda: net(torch.randn(2, 8)))
    _step(net, opt, torch.randn(6, 8))
    net.set_requires_gradient_sync(False)
    refused(r"without gradient sync.*hsdp.microbatch", lambda: net(torch.randn(2, 8)))
    net.set_requires_gradient_sync(True)
    fresh = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # no state yet
    net(torch.randn(2, 8)).sum().backward()
    refused(r"optimizer step that creates or changes its state.*first step eagerly",
            fresh.step)
    g = rt.ctx.groups[0]
    for target, name, value, match in [
            (g, "outer", (hsdp.DiLoCo(inner_steps=2),), "DiLoCo"),
            (rt.ctx, "comms", dataclasses.replace(rt.ctx.comms, elastic=object()),
             "fault tolerance"),
            (g, "outer", (hsdp.OuterReduce("int8"),), None),  # no codec: nothing to refuse
            (g, "compressed", _Unready(), "before its first optimizer step"),
            (g.buffers, "float8", object(), "float8 all-gather")]:
        with monkeypatch.context() as m:
            m.setattr(target, name, value)
            if name == "compressed":
                m.setattr(g, "outer", (hsdp.OuterReduce("int8"),))
            whats = [what for what, _ in rt.graphs.refusals("optimizer step")]
            assert any(match in what for what in whats) if match else not whats, whats
    opt.zero_grad(set_to_none=False)
    _step(net, opt, torch.randn(6, 8))  # the model still trains, eagerly
    hsdp.synchronize(net)


def test_cleared_gradients_after_a_replay_are_refused_at_the_step(world_1, monkeypatch):
    """A captured backward writes the gradient buffers at each replay: clearing the
    ``.grad``s with set_to_none between replay and step would make the optimizer skip
    them, so the step raises, naming it."""
    net = _net(world_1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _step(net, opt, torch.randn(6, 8))
    with monkeypatch.context() as m:
        m.setattr(net._hsdp_unit.runtime.ctx.streams.compute, "capturing", lambda: True)
        net(torch.randn(2, 8)).sum().backward()
    opt.zero_grad(set_to_none=True)
    with pytest.raises(CaptureError, match=r"set_to_none=True.*set_to_none=False"):
        opt.step()


def test_capture_scope_tells_a_new_capture_from_the_one_under_way():
    """Events are marked with the capture they were recorded in: a capture on another
    stream, or one whose joined side streams left it, is a new one; eager is None."""
    scope = CaptureScope()
    assert scope.current is None and not scope.sync(False, 1, True)
    assert scope.sync(True, 1, True) and scope.current == 1
    assert scope.sync(True, 1, True) and scope.current == 1  # the same capture
    scope.sync(True, 2, True)
    assert scope.current == 2  # another origin stream
    scope.sync(True, 2, False)
    assert scope.current == 3  # the side streams that joined have left it
    scope.sync(False, 2, True)
    assert scope.current is None


class _Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer: an optimizer whose step steps the ones it holds
    (its own pre- and post-step hooks run around theirs)."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})

    def step(self, closure=None):
        self.inner.step()


def test_nested_optimizers_check_a_replayed_step_once(world_1, monkeypatch):
    """The agreement on what a graph ran runs once per optimizer step, also when an
    optimizer steps another (each check waits for the device's previous step: twice per
    step made the host wait for the step it had just issued)."""
    net = _net(world_1)
    opt = _Container(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    _step(net, opt, torch.randn(6, 8))
    for _ in range(3):
        with monkeypatch.context() as m:
            m.setattr(net._hsdp_unit.runtime.ctx.streams.compute, "capturing", lambda: True)
            net(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert net._hsdp_unit.runtime.graphs.steps == 3


def test_a_captured_step_adds_uncleared_gradients_where_they_lie(world_1, monkeypatch):
    """A captured step of one backward whose gradients reach ``accum`` through the outer
    all-reduce of the bf16 reduce-scatter result (an all-reduce hook keeps it on a 1x1
    mesh): the uncleared gradients are added by that all-reduce where they lie, never
    copied; the root, fp32 reduced, copies them as before. Gradients left set on some
    steps, cleared on others: the same parameters as eager, bit for bit."""
    mp = hsdp.MixedPrecision(reduce_dtype=torch.bfloat16)
    eager, captured = _net(world_1, mp_policy=mp), _net(world_1, mp_policy=mp)
    for m in (eager, captured):
        for unit in (m[0], m[2]):
            unit.set_all_reduce_hook(lambda t: None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, captured)]
    xs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    for m, opt in zip((eager, captured), opts):  # gradients and optimizer state exist
        _step(m, opt, xs[0])
    kept: dict[int, list] = {}
    hide = hsdp.sharding.group_grads.GradientState.hide_grads

    def spy(grads, capturing=False, single=False):
        hide(grads, capturing, single)
        kept.setdefault(id(grads), []).append((grads.carry is None, grads.carry_in_buf))

    monkeypatch.setattr(hsdp.sharding.group_grads.GradientState, "hide_grads", spy)
    compute = captured._hsdp_unit.runtime.ctx.streams.compute
    for k, x in enumerate(xs[1:]):
        for m, opt in zip((eager, captured), opts):
            with monkeypatch.context() as mc:
                if m is captured:
                    mc.setattr(compute, "capturing", lambda: True)
                m(x).square().mean().backward()
            opt.step()
            if k % 2:  # even steps leave the gradients set
                opt.zero_grad(set_to_none=False)
    for a, b in zip(eager.parameters(), captured.parameters()):
        assert torch.equal(a.detach().full_tensor(), b.detach().full_tensor())
    in_place = [g.grads for u in (captured[0], captured[2]) for g in u._hsdp_unit.groups]
    root = [g.grads for g in captured._hsdp_unit.groups]
    assert all(kept[id(g)][-4:] == [(True, True)] * 4 for g in in_place), kept
    assert all(kept[id(g)][-4:] == [(False, False)] * 4 for g in root), kept
