"""An hsdp model inside a CUDA graph capture raises a clear error before anything runs:
its runtime waits on the host for its own streams' collectives, which a capture forbids
(torchtitan captures forward + backward by default on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hsdp
from hsdp.runtime.state import Phase


def test_forward_under_capture_is_refused_before_it_starts(fake_world_8, monkeypatch):
    mesh = hsdp.init_mesh(2, 4, "cpu")
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    hsdp.fully_shard(net[0], mesh=mesh)
    hsdp.fully_shard(net, mesh=mesh)
    net(torch.randn(2, 8)).sum().backward()
    hsdp.synchronize(net)
    root = net._hsdp_unit
    # stands for a CUDA model while torch.cuda.graph captures the current stream
    monkeypatch.setattr(root, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture.*"
                                           "disable_cuda_graphs"):
        net(torch.randn(2, 8))
    assert root.runtime.step.phase is Phase.IDLE  # nothing started
    monkeypatch.undo()
    net(torch.randn(2, 8)).sum().backward()  # and the model still trains
    hsdp.synchronize(net)
