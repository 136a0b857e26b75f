"""The optimizer state hsdp builds for a parameter without any (``lazy_state``) makes the
next step exactly torch's first step, for every configuration it builds one for."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from hsdp.checkpoint.lazy_state import initial_state

BUILT = {
    "sgd": partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "sgd-nesterov": partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True),
    "sgd-foreach": partial(torch.optim.SGD, lr=0.1, momentum=0.9, foreach=True),
    "sgd-no-momentum": partial(torch.optim.SGD, lr=0.1),
    "adam": partial(torch.optim.Adam, lr=1e-2),
    "adam-amsgrad": partial(torch.optim.Adam, lr=1e-2, amsgrad=True),
    "adamw-foreach": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True),
}


def _two_steps(make, built: bool) -> tuple[torch.Tensor, dict]:
    """Two steps of one parameter from the same start; ``built``: its state is
    ``initial_state``'s before the first."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(7))
    opt = make([p])
    if built:
        state = initial_state(opt, opt.param_groups[0], p)
        assert state is not None
        opt.state[p].update(state)
    for _ in range(2):
        p.grad = torch.randn(7)
        opt.step()
    return p.detach().clone(), dict(opt.state[p])


@pytest.mark.parametrize("kind", list(BUILT))
def test_built_state_steps_exactly_like_torch_lazy_state(kind: str) -> None:
    want_p, want_state = _two_steps(BUILT[kind], built=False)
    got_p, got_state = _two_steps(BUILT[kind], built=True)
    assert torch.equal(got_p, want_p)
    assert got_state.keys() == want_state.keys()
    for k, v in want_state.items():
        assert torch.equal(got_state[k], v) and got_state[k].dtype == v.dtype, k
        assert got_state[k].device == v.device, k


@pytest.mark.parametrize("make", [partial(torch.optim.SGD, lr=0.1, momentum=0.9,
                                          dampening=0.5),
                                  partial(torch.optim.RMSprop, lr=0.1)])
def test_no_state_where_it_cannot_be_exact(make) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    opt = make([p])
    assert initial_state(opt, opt.param_groups[0], p) is None
    assert not opt.state
