"""Compiled blocks: torch.compile(block) before or after fully_shard and block.compile()
(before or after) compile with fullgraph=True and no graph break from hsdp (fake world:
graph structure only; values are checked on 4 gloo ranks in test_drop_in.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import hsdp

MODES = ("wrap_before", "wrap_after", "method_before", "method_after")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.out(x)


def compile_blocks(net: Net, mesh, mode: str, **shard_kwargs) -> None:
    """fully_shard every block and the root, compiling the blocks as ``mode`` says."""
    opts = {"backend": "aot_eager", "fullgraph": True}
    for i, blk in enumerate(net.blocks):
        if mode == "wrap_before":
            net.blocks[i] = blk = torch.compile(blk, **opts)
        elif mode == "method_before":
            blk.compile(**opts)
        hsdp.fully_shard(blk, mesh=mesh, **shard_kwargs)
        if mode == "wrap_after":
            net.blocks[i] = torch.compile(blk, **opts)
        elif mode == "method_after":
            blk.compile(**opts)
    hsdp.fully_shard(net, mesh=mesh, **shard_kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_blocks_compile_fullgraph_without_graph_breaks(fake_world_8, mode):
    torch._dynamo.reset()
    counters.clear()
    mesh = hsdp.init_mesh(2, 4, "cpu")
    torch.manual_seed(0)
    net = Net()
    compile_blocks(net, mesh, mode)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    graphs = []
    for _ in range(3):
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # The blocks ran compiled and nothing recompiled after the first step, although hsdp
    # swaps sharded / unsharded parameters around each call.
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], (graphs, dict(counters["stats"]))
    hsdp.synchronize(net)
