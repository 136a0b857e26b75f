"""Expert parallelism's token exchange (``models_moe``' ``MoELlama``): the all-to-all of the
routed tokens over the ep group and back, as torchtitan runs it (the backward of each
all-to-all is the other). Under torch's fake process group an all-to-all moves nothing: a
tool gives ``EPExchange`` a ``delay`` (``bench step`` sleeps the compute stream for the
exchange's modelled time on the inner link), and the simulator drops the exchange and
prices it (``hsdp_tools.sim.ep_pricing``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

EP_KEY = "all_to_all:ep"  # the exchange's bytes in a trainee's ``collective_bytes``


class EPExchange:
    """The all-to-all of routed tokens over the ep ``group`` (None: one rank, nothing
    moves), each preceded by ``delay(nbytes, ranks)`` (if set: an emulation's) and its
    bytes added to ``nbytes[EP_KEY]`` (if given)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.delay: Callable[[int, int], None] | None = None
        self.nbytes: dict[str, int] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return x
        return _AllToAll.apply(x, self)

    def send(self, x: torch.Tensor) -> torch.Tensor:
        """Row r of ``x`` ([ep, ...]) to ep rank r; row r of the result from ep rank r."""
        x = x.contiguous()
        size = x.numel() * x.element_size()
        if self.nbytes is not None:
            self.nbytes[EP_KEY] = self.nbytes.get(EP_KEY, 0) + size
        if self.delay is not None:
            self.delay(size, dist.get_world_size(self.group))
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: EPExchange) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange.send(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.exchange.send(grad), None
